"""examples/ds_plain under `nebula launch` in a test: the example copied and edited, a spec file,
the launch, its records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml
from helpers.jobs import CLI, REPO, job_processes

INNER = 10


def spec_file(tmp_path: Path, name: str, clusters: dict[str, list[str]], run: str,
              **extra: Any) -> Path:
    spec = yaml.safe_load((EXAMPLE / "nebula.yaml").read_text())
    spec.update(name=name, workdir=str(tmp_path / "work"), run=run, **extra)
    spec["clusters"] = [{"name": c, "transport": "local", "hosts": [{"host": h} for h in hosts]}
                        for c, hosts in clusters.items()]
    spec["relay"]["sync"]["inner_steps"] = INNER
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def copy_example(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    return work


def edited(text: str, *changes: tuple[str, str]) -> str:
    for old, new in changes:
        assert old in text, f"examples/ds_plain/train.py no longer has {old!r}"
        text = text.replace(old, new)
    return text


def records(cli: CLI, job_id: str, role: str = "worker") -> list[dict[str, Any]]:
    out = []
    for path in job_files(cli, job_id, f"*/*/{role}/metrics/*.jsonl"):
        out += [json.loads(line) for line in path.read_text().splitlines() if line]
    return out


def launched(cli: CLI, spec: Path) -> tuple[str, str]:
    proc = cli("launch", str(spec), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job_id,) = cli.job_ids()
    st = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED", st
    assert job_processes(job_id) == []
    return job_id, proc.stdout


EXAMPLE = REPO / "examples" / "ds_plain"


def job_files(cli: CLI, job_id: str, pattern: str) -> list[Path]:
    return sorted((cli.home / "jobs" / job_id).glob(pattern))
