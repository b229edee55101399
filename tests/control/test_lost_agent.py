"""A job whose host agents are SIGKILLed (a real local job, real agents): `nebula status` does
not show them running forever. With restarts left the control plane's look replaces the agent
and its work is restarted (the job runs on); with none, the job is FAILED with a reason that
names the dead agent and says what to do."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from helpers.jobs import CLI, wait_for, write_spec

SPEC = """
name: longrun
workdir: .
run: echo "start on $NEBULA_HOST"; exec sleep 600
clusters:
  - name: east
    transport: local
    hosts: [{host: e1}]
    max_restarts: 1
  - name: west
    transport: local
    hosts: [{host: w1}]
    max_restarts: 0
"""


def _status(cli: CLI, job_id: str) -> dict[str, Any]:
    return json.loads(cli("status", job_id, "--json", check=True).stdout)


def _host(st: dict[str, Any], host: str) -> dict[str, Any]:
    return next(h for h in st["hosts"] if h["host"] == host)


@pytest.mark.slow  # a launch (no DeepSpeed): ~15 s idle, ~40 s on a loaded machine
def test_dead_agents_are_replaced_or_fail_the_job_with_what_to_do(cli: CLI,
                                                                  tmp_path: Path) -> None:
    job_id = cli("launch", str(write_spec(tmp_path, SPEC)), "--detach", check=True).stdout.strip()
    st = wait_for(lambda: (s := _status(cli, job_id))["hosts"]
                  and all(h["state"] == "RUNNING" for h in s["hosts"]) and s, timeout=60)
    victim = _host(st, "e1")
    os.kill(victim["detail"]["agent_pid"], signal.SIGKILL)  # restarts left: replaced
    after = wait_for(lambda: (s := _status(cli, job_id)) and _host(s, "e1")["state"] ==
                     "RUNNING" and _host(s, "e1")["pid"] != victim["pid"] and s, timeout=60)
    e1 = _host(after, "e1")
    assert after["state"] == "RUNNING" and e1["restarts"] == 1
    assert e1["detail"]["agent_pid"] != victim["detail"]["agent_pid"]
    assert "agent" in e1["detail"]["reason"] and "died" in e1["detail"]["reason"]
    assert not _alive(victim["pid"])  # the orphaned worker was ended, not doubled
    assert "RUNNING" in cli("status", job_id).stdout

    os.kill(_host(after, "w1")["detail"]["agent_pid"], signal.SIGKILL)  # none left: FAILED
    final = wait_for(lambda: (s := _status(cli, job_id))["state"] != "RUNNING" and s,
                     timeout=60)
    assert final["state"] == "FAILED"
    assert "agent" in final["reason"] and "died" in final["reason"]
    assert f"nebula resume {job_id}" in final["reason"]
    assert "FAILED" in cli("status", job_id).stdout


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
