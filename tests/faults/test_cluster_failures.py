"""A rank that dies before the rendezvous: the cluster's other host leaves it at once, with
nobody looking at the job. A worker killed on one host of a two-host cluster: the cluster's
other host fails out of its broken collective at once (no rank hangs), both hosts restart their
ranks, the world meets again, resumes from the checkpoint every rank has, and the job ends
SUCCEEDED with every worker identical. The other cluster trains on meanwhile."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
import yaml
from helpers.checkpoint_jobs import (
    _records,
    kill_rank,
    newest_checkpoint,
    slowed_ds_plain,
    wait_ended,
)
from helpers.jobs import CLI, job_processes, shm_leftovers, wait_for, wait_in_job

from nebula_cli.runtime.worldwatch import ABORT_EXIT

STEPS, EVERY = 80, 10  # a round every test_checkpoint.INNER steps


@pytest.mark.slow
def test_a_rank_killed_on_one_host_restarts_its_whole_cluster(cli: CLI, tmp_path: Path) -> None:
    spec_path = slowed_ds_plain(tmp_path, "clusterkill", STEPS, max_restarts=2,
                                checkpoint={"every": EVERY})
    spec = yaml.safe_load(spec_path.read_text())  # east: e1 and e2
    assert [len(c["hosts"]) for c in spec["clusters"]] == [2, 1]
    job_id = cli("launch", str(spec_path), "--detach", check=True).stdout.strip()
    seen = wait_in_job(cli, job_id, lambda: (n := newest_checkpoint(cli, job_id, "east"))
                       >= 2 * EVERY and n, 180, f"east's checkpoint of step {2 * EVERY}")
    kill_rank(job_id, "east", "1")  # e2's only rank
    st = wait_ended(cli, job_id, timeout=300)
    assert st["state"] == "SUCCEEDED", st
    restarts = {h["host"]: h["restarts"] for h in st["hosts"] if h["role"] == "worker"}
    assert restarts["e1"] >= 1 and restarts["e2"] >= 1 and restarts["w1"] == 0, restarts
    recs = _records(cli, job_id)
    resumed = {r["resumed_from_step"] for r in recs if r.get("cluster") == "east"
               and "resumed_from_step" in r and not r.get("final")}
    assert len(resumed) == 1 and seen <= min(resumed), resumed  # one agreed checkpoint
    # no helper of the restart (the agent's world teller) wrote into a rank's records (#30)
    assert not [r for r in recs if r.get("no_deepspeed_engine") or r.get("rank") is None]
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
    spec_path = slowed_ds_plain(tmp_path, "lostwest", STEPS, min_clusters=1)
    job_id = cli("launch", str(spec_path), "--detach", check=True).stdout.strip()

    def joint_rounds() -> int:
        return sum(1 for r in _records(cli, job_id) if r.get("cluster") == "east"
                   and r.get("clusters_present") == 2)

    wait_in_job(cli, job_id, lambda: joint_rounds() >= 2, 180, "two rounds with both clusters")
    kill_rank(job_id, "west", "0")
    killed_at = time.time()
    st = wait_ended(cli, job_id, timeout=300)
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


WAITS_FOR_A_DEAD_RANK = """\
import os
import sys

import torch.distributed as dist

if os.environ["NEBULA_NODE_RANK"] == "1":  # fails before it ever reaches the master
    sys.exit("no route to the master")
dist.init_process_group("gloo")  # without nebula: waits 30 minutes for the rank above
print("the world met", flush=True)
"""


@pytest.mark.slow
def test_a_rank_that_dies_before_the_rendezvous_leaves_nobody_waiting(
        cli: CLI, tmp_path: Path) -> None:
    """Seen as a new user: two ranks exited 1 and the others waited in the rendezvous for good.
    Nobody looks at the job here (no status, no live view): the agents alone must end it."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "rendezvous.py").write_text(WAITS_FOR_A_DEAD_RANK)
    spec = {"name": "deadrank", "workdir": str(work), "run": "python -u rendezvous.py",
            "clusters": [{"name": "c", "transport": "local",
                          "hosts": [{"host": "h1"}, {"host": "h2"}]}]}
    path = tmp_path / "deadrank.yaml"
    path.write_text(yaml.safe_dump(spec))
    job_id = cli("launch", str(path), "--detach", check=True).stdout.strip()
    t0 = time.monotonic()

    def agent_states() -> dict[str, dict]:
        found = {}
        for status in (cli.home / "jobs" / job_id).glob("c/*/worker/status.json"):
            with contextlib.suppress(ValueError):
                found[status.parent.parent.name] = json.loads(status.read_text())
        return found

    ended = wait_for(lambda: (s := agent_states()) and len(s) == 2 and all(
        a["state"] == "FAILED" for a in s.values()) and s, timeout=120)
    assert time.monotonic() - t0 < 90
    assert "no route to the master" in ended["h2"]["reason"]
    assert ended["h1"]["exit_code"] == ABORT_EXIT, ended["h1"]
    assert "host h2 of cluster c" in ended["h1"]["reason"], ended["h1"]["reason"]
    wait_for(lambda: job_processes(job_id) == [], timeout=30)
    st = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "FAILED"
