"""A real agent whose rank writes far past the spec's rotation bound: its log (through the
log pump) and its metrics records (the runtime's writer) rotate, every line and record kept is
there in order, what the user reads (the agent's status summary) is the newest, and the disk
use stays under the bound; the pump outlives its agent and ends with its rank's output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from helpers.jobs import wait_for

from nebula_cli.agent import summary
from nebula_cli.config.rotation import Rotation, paths_oldest_first

REPO = Path(__file__).resolve().parents[2]
LINES = 6000
RANK = """
import sys, time
from nebula_cli.runtime import metrics
for i in range({lines}):
    print(f"line {{i}} " + "x" * (i % 40), flush=(i % 50 == 0))
    metrics.log(step=i, loss=i / 1000)
    if i % 1000 == 0:
        time.sleep(0.05)
sys.stdout.flush()
time.sleep({linger})
"""


def _agent(*args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "nebula_cli.agent", *args], capture_output=True,
                         text=True, timeout=60, check=True, cwd=REPO)
    return json.loads(out.stdout)


def _make(tmp_path: Path, rotation: Rotation, linger: float = 0.0) -> Path:
    d = tmp_path / "agent"
    d.mkdir()
    (tmp_path / "rank.py").write_text(RANK.format(lines=LINES, linger=linger))
    proc = {"name": "0", "argv": [sys.executable, str(tmp_path / "rank.py")],
            "env": {"PYTHONPATH": str(REPO),
                    "NEBULA_METRICS_FILE": str(d / "metrics" / "rank0.jsonl")},
            "log": "logs/rank0.log", "metrics": "metrics/rank0.jsonl"}
    cfg = {"job_id": "t", "cluster": "c", "host": "h", "role": "worker", "cwd": str(tmp_path),
           "grace": 5, "max_restarts": 0, "restart_backoff": 0.2, "processes": [proc],
           "rotation": {"max_bytes": rotation.max_bytes, "keep": rotation.keep},
           "world_secret": ""}
    (d / "agent.json").write_text(json.dumps(cfg))
    return d


def _kept(path: Path, keep: int) -> list[str]:
    return [line for p in paths_oldest_first(str(path), keep) if os.path.exists(p)
            for line in Path(p).read_text().splitlines()]


def _on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def test_logs_and_metrics_rotate_and_keep_every_line(tmp_path: Path) -> None:
    rotation = Rotation(max_bytes=32 << 10, keep=100)  # room for all: nothing may be lost
    d = _make(tmp_path, rotation)
    _agent("start", str(d))
    status = wait_for(lambda: (s := _agent("status", str(d))[0])["state"] == "SUCCEEDED" and s,
                      timeout=60)
    log, records = d / "logs" / "rank0.log", d / "metrics" / "rank0.jsonl"
    lines = [x for x in _kept(log, 100) if x.startswith("line ")]
    assert lines == [f"line {i} " + "x" * (i % 40) for i in range(LINES)]
    assert os.path.exists(f"{log}.3") and os.path.exists(f"{records}.3")  # it rotated
    steps = [json.loads(x)["step"] for x in _kept(records, 100)]
    assert steps == list(range(LINES))
    assert status["metrics"]["0"]["latest"]["step"] == LINES - 1  # the newest, read cheaply
    assert status["metrics"]["0"]["read"] <= summary.SCAN_BYTES


def test_disk_stays_under_the_bound_and_the_summary_follows_rotations(tmp_path: Path) -> None:
    rotation = Rotation(max_bytes=16 << 10, keep=2)
    d = _make(tmp_path, rotation, linger=30)
    log, records = d / "logs" / "rank0.log", d / "metrics" / "rank0.jsonl"
    pid = _agent("start", str(d))["agent_pid"]
    seen = []
    try:
        while True:  # status while it writes: every answer is the newest step, never older
            s = _agent("status", str(d))[0]
            step = s.get("metrics", {}).get("0", {}).get("latest", {}).get("step")
            if step is not None:
                seen.append(step)
            if step == LINES - 1:
                break
            assert s["state"] == "RUNNING", s
            time.sleep(0.05)
        assert seen == sorted(seen)
        for path in (log, records):
            assert _on_disk(path) <= rotation.bound(), path
            assert not os.path.exists(f"{path}.3")
        kept = [int(x.split()[1]) for x in _kept(log, 2) if x.startswith("line ")]
        assert kept == list(range(kept[0], LINES)) and kept[0] > 0  # the newest, whole
        pump = next(p for p in _marked(d) if p != s["pid"])
        os.kill(pid, signal.SIGKILL)  # the agent dies: its rank's output still reaches the log
        assert _marked(d)  # the rank and its pump live on
    finally:
        _agent("stop", str(d), "--force")
    assert wait_for(lambda: not _alive(pump), timeout=10)


def _marked(d: Path) -> list[int]:
    from nebula_cli.agent.supervisor import marked_pids

    return marked_pids(d)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
