"""A host agent killed with SIGKILL while its processes run: `status` sees it LOST and says
that its processes run on unsupervised; `revive` replaces it (the old processes ended, new
ones started as a failed rank's restart, counted against max_restarts), or, with no restarts
left, records FAILED with what to do. Real detached agents, real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers.jobs import wait_for

from nebula_cli.agent.supervisor import marked_pids, pid_alive

REPO = Path(__file__).resolve().parents[2]


def _agent(*args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "nebula_cli.agent", *args], capture_output=True,
                         text=True, timeout=60, check=True, cwd=REPO)
    return json.loads(out.stdout)


def _make(tmp_path: Path, max_restarts: int) -> Path:
    d = tmp_path / "agent"
    d.mkdir()
    proc = {"name": "0", "argv": ["/bin/sh", "-c", 'echo "up $$"; exec sleep 300'],
            "env": {}, "log": "logs/rank0.log", "metrics": None}
    cfg = {"job_id": "j1", "cluster": "c", "host": "h", "role": "worker", "cwd": str(tmp_path),
           "grace": 2, "max_restarts": max_restarts, "restart_backoff": 0.2,
           "processes": [proc], "rotation": {"max_bytes": 1 << 20, "keep": 1},
           "world_secret": ""}
    (d / "agent.json").write_text(json.dumps(cfg))
    return d


def _kill_agent(d: Path) -> dict[str, Any]:
    before = wait_for(lambda: (s := _agent("status", str(d))[0])["state"] == "RUNNING" and s)
    os.kill(before["agent_pid"], signal.SIGKILL)
    return before


def test_a_killed_agent_is_lost_then_revived_with_new_processes(tmp_path: Path) -> None:
    d = _make(tmp_path, max_restarts=1)
    _agent("start", str(d))
    try:
        before = _kill_agent(d)
        lost = wait_for(lambda: (s := _agent("status", str(d))[0])["state"] == "LOST" and s)
        assert lost["agent_lost"] and lost["group_alive"]
        assert "died" in lost["reason"] and "still run, unsupervised" in lost["reason"]
        assert pid_alive(before["pid"])  # the work went on without its agent

        (revived,) = _agent("revive", str(d))
        assert revived["state"] in ("RESTARTING", "RUNNING")
        assert revived["agent_pid"] != before["agent_pid"] and pid_alive(revived["agent_pid"])
        after = wait_for(lambda: (s := _agent("status", str(d))[0])["state"] == "RUNNING"
                         and s["pid"] != before["pid"] and s)
        assert not pid_alive(before["pid"])  # the orphan was ended, not left beside the new one
        assert after["restarts"] == 1
        # RUNNING says the new process started, not that its shell has written yet: wait for
        # its line (seen once in CI: read before the new shell's echo)
        log = d / "logs" / "rank0.log"
        assert wait_for(lambda: f"up {after['pid']}\n" in log.read_text()), log.read_text()
        assert log.read_text().split("\n")[:2] == [f"up {before['pid']}", f"up {after['pid']}"]
        events = [json.loads(x)["kind"] for x in (d / "events.jsonl").read_text().splitlines()]
        assert "agent-lost" in events
        (again,) = _agent("revive", str(d))  # a live agent is left as it is
        assert again["agent_pid"] == revived["agent_pid"]
    finally:
        _agent("stop", "--force", str(d))
    assert not marked_pids(d.resolve())


def test_with_no_restarts_left_a_revived_agent_says_what_to_do(tmp_path: Path) -> None:
    d = _make(tmp_path, max_restarts=0)
    _agent("start", str(d))
    try:
        before = _kill_agent(d)
        _agent("revive", str(d))
        failed = wait_for(lambda: (s := _agent("status", str(d))[0])["state"] == "FAILED" and s)
        assert "no restarts left" in failed["reason"] and "nebula resume j1" in failed["reason"]
        assert not pid_alive(before["pid"]) and not failed["group_alive"]
    finally:
        _agent("stop", "--force", str(d))
    assert not marked_pids(d.resolve())
