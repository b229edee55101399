"""Jobs over the SSH test bed: a spec for its hosts (`ssh_spec`), a job's records read from the
hosts' job folders."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml
from helpers.jobs import REMOTE_JOBS
from testbed import TestBed


def ssh_spec(tmp_path: Path, bed: TestBed, *, clusters: dict[str, list[str]], run: str,
             relay: dict[str, Any] | None = None, name: str = "sshjob",
             workdir: Path | None = None, deepspeed: str | None = None,
             extra: dict[str, Any] | None = None) -> Path:
    spec: dict[str, Any] = {
        "name": name, "workdir": str(workdir or tmp_path), "run": run,
        "env": {"OMP_NUM_THREADS": "1"},
        "clusters": [  # no `interface:`: each host finds the one that reaches its peers
            {"name": c, "transport": "ssh", "python": sys.executable,
             "hosts": [{"host": h} for h in hosts]}
            for c, hosts in clusters.items()
        ],
    }
    if relay is not None:
        spec["relay"] = relay
    if deepspeed:
        spec["deepspeed"] = deepspeed
    spec.update(extra or {})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def records(job_id: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted((REMOTE_JOBS / job_id).glob("*/*/worker/metrics/*.jsonl")):
        out += [json.loads(x) for x in path.read_text().splitlines() if x]
    return out
