"""A worker killed on one host of a two-host cluster: the cluster's other host fails out of its
broken collective at once (no rank hangs), both hosts restart their ranks, the world meets
again, resumes from the checkpoint every rank has, and the job ends SUCCEEDED with every
worker identical. The other cluster trains on meanwhile."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CLI, REPO, job_processes, shm_leftovers, wait_for
from test_checkpoint import _rank_pids, _records

STEPS, INNER, EVERY = 80, 10, 10


@pytest.mark.slow
def test_a_rank_killed_on_one_host_restarts_its_whole_cluster(cli: CLI, tmp_path: Path) -> None:
    example = REPO / "examples" / "ds_plain"
    work = tmp_path / "work"
    shutil.copytree(example, work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    script = (work / "train.py").read_text()
    slow = "            engine.step()\n"
    assert slow in script, "examples/ds_plain/train.py changed its loop"
    (work / "train.py").write_text(script.replace(
        slow, slow + "        __import__('time').sleep(0.05)\n", 1))
    spec = yaml.safe_load((example / "nebula.yaml").read_text())  # east: e1 and e2
    assert [len(c["hosts"]) for c in spec["clusters"]] == [2, 1]
    spec.update(name="clusterkill", workdir=str(work), run=f"python -u train.py --steps {STEPS}",
                max_restarts=2, checkpoint={"every": EVERY})
    spec["relay"].update(timeout=10, heartbeat=1, dead_after=3)
    spec["relay"]["sync"]["inner_steps"] = INNER
    spec_path = tmp_path / "clusterkill.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    job_id = cli("launch", str(spec_path), "--detach", check=True).stdout.strip()

    def east_checkpoint() -> int:
        return max((r["checkpoint_step"] for r in _records(cli, job_id)
                    if r.get("cluster") == "east" and "checkpoint_step" in r), default=0)

    seen = wait_for(lambda: east_checkpoint() >= 2 * EVERY and east_checkpoint(), timeout=180)
    victims = _rank_pids(job_id, "east", "1")  # e2's only rank
    assert victims, "east's rank 1 is not running"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)

    def ended() -> dict[str, Any] | None:
        st = json.loads(cli("status", job_id, "--json", check=True).stdout)
        return st if st["state"] not in ("RUNNING", "STARTING") else None

    st = wait_for(ended, timeout=300, every=1.0)
    assert st["state"] == "SUCCEEDED", st
    restarts = {h["host"]: h["restarts"] for h in st["hosts"] if h["role"] == "worker"}
    assert restarts["e1"] >= 1 and restarts["e2"] >= 1 and restarts["w1"] == 0, restarts
    recs = _records(cli, job_id)
    resumed = {r["resumed_from_step"] for r in recs if r.get("cluster") == "east"
               and "resumed_from_step" in r and not r.get("final")}
    assert len(resumed) == 1 and seen <= min(resumed), resumed  # one agreed checkpoint
    finals = [r for r in recs if r.get("final")]
    assert len(finals) == 3 and all(r["step"] == STEPS for r in finals)
    assert len({r["param_sha256"] for r in finals}) == 1, finals
    assert job_processes(job_id) == []
    assert shm_leftovers(cli.home / "jobs" / job_id) == []


@pytest.mark.slow
def test_min_clusters_lets_the_others_train_on_without_a_lost_cluster(
        cli: CLI, tmp_path: Path) -> None:
    """west's only rank is SIGKILLed with no restarts left; with `min_clusters: 1` west alone is
    stopped (its relay too), east's relay drops it and east trains to the end: SUCCEEDED, and
    status names the lost cluster."""
    example = REPO / "examples" / "ds_plain"
    work = tmp_path / "work"
    shutil.copytree(example, work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    script = (work / "train.py").read_text()
    slow = "            engine.step()\n"
    (work / "train.py").write_text(script.replace(
        slow, slow + "        __import__('time').sleep(0.05)\n", 1))
    spec = yaml.safe_load((example / "nebula.yaml").read_text())
    spec.update(name="lostwest", workdir=str(work), run=f"python -u train.py --steps {STEPS}",
                min_clusters=1)
    spec["relay"].update(timeout=10, heartbeat=1, dead_after=3)
    spec["relay"]["sync"]["inner_steps"] = INNER
    spec_path = tmp_path / "lostwest.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    job_id = cli("launch", str(spec_path), "--detach", check=True).stdout.strip()

    def joint_rounds() -> int:
        return sum(1 for r in _records(cli, job_id) if r.get("cluster") == "east"
                   and r.get("clusters_present") == 2)

    wait_for(lambda: joint_rounds() >= 2, timeout=180)
    victims = _rank_pids(job_id, "west", "0")  # its shell and its python
    assert victims, "west's rank 0 is not running"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.time()

    def ended() -> dict[str, Any] | None:
        st = json.loads(cli("status", job_id, "--json", check=True).stdout)
        return st if st["state"] not in ("RUNNING", "STARTING") else None

    st = wait_for(ended, timeout=300, every=1.0)
    assert st["state"] == "SUCCEEDED", st
    assert "west/w1 worker" in (st.get("reason") or ""), st
    states = {(h["cluster"], h["role"]): h["state"] for h in st["hosts"] if h["host"] != "e2"}
    assert states[("west", "worker")] == "FAILED" and states[("west", "relay")] == "STOPPED"
    assert states[("east", "worker")] == "SUCCEEDED"
    recs = _records(cli, job_id)
    later = [r for r in recs if r.get("cluster") == "east" and r.get("outer_round") is not None
             and r["ts"] > killed_at]  # the first may have been in flight at the kill
    assert len(later) >= 3 and all(r["clusters_present"] == 1 for r in later[1:]), later
    finals = [r for r in recs if r.get("final")]
    assert {r["cluster"] for r in finals} == {"east"} and all(r["step"] == STEPS for r in finals)
    shown = cli("status", job_id, check=True).stdout
    assert "FAILED" in shown and "west" in shown  # the lost cluster stays in view
    assert job_processes(job_id) == []
