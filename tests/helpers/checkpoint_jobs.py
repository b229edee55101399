"""Checkpoint tests on launched jobs: a slowed ds_plain job, a rank killed, the newest checkpoint,
a job's records, waiting for its end."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import yaml
from helpers.jobs import CLI, REPO, job_processes, wait_for


def _records(cli: CLI, job_id: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted((cli.home / "jobs" / job_id).glob("*/*/worker/metrics/*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line]
    return out


def slowed_ds_plain(tmp_path: Path, name: str, steps: int, **fields: Any) -> Path:
    """examples/ds_plain copied to tmp_path/work, slow enough to be killed mid-run; its spec
    as `name`, `steps` long, with the fault tests' relay timings, a round every INNER steps and
    `fields` set (top-level keys); the spec file written beside it."""
    example = REPO / "examples" / "ds_plain"
    work = tmp_path / "work"
    shutil.copytree(example, work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    script = (work / "train.py").read_text()
    slow = "            engine.step()\n"
    assert slow in script, "examples/ds_plain/train.py changed its loop"
    (work / "train.py").write_text(script.replace(
        slow, slow + "        __import__('time').sleep(0.05)\n", 1))
    spec = yaml.safe_load((example / "nebula.yaml").read_text())
    spec.update(name=name, workdir=str(work), run=f"python -u train.py --steps {steps}",
                **fields)
    spec["relay"].update(timeout=10, heartbeat=1, dead_after=3)
    spec["relay"]["sync"]["inner_steps"] = INNER
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def newest_checkpoint(cli: CLI, job_id: str, cluster: str) -> int:
    return max((r["checkpoint_step"] for r in _records(cli, job_id)
                if r.get("cluster") == cluster and "checkpoint_step" in r), default=0)


def kill_rank(job_id: str, cluster: str, rank: str) -> None:
    """SIGKILL one rank of a cluster (its shell and its python)."""
    victims = _rank_pids(job_id, cluster, rank)
    assert victims, f"{cluster}'s rank {rank} is not running"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)


def wait_ended(cli: CLI, job_id: str, timeout: float) -> dict[str, Any]:
    """The job's status once it is neither RUNNING nor STARTING."""
    def ended() -> dict[str, Any] | None:
        st = json.loads(cli("status", job_id, "--json", check=True).stdout)
        return st if st["state"] not in ("RUNNING", "STARTING") else None

    return wait_for(ended, timeout=timeout, every=1.0)


INNER = 10


def _rank_pids(job_id: str, cluster: str, rank: str) -> list[int]:
    """The training processes of one rank (its environment names the cluster and the rank)."""
    pids = []
    for pid in job_processes(job_id):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (f"NEBULA_CLUSTER={cluster}".encode() in env and f"RANK={rank}".encode() in env
                and b"train.py" in cmd):
            pids.append(pid)
    return pids
