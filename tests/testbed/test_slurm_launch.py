"""nebula on a real Slurm cluster (the test bed's: slurmctld on an SSH login node, slurmd on two
compute nodes that have no SSH), training with an SSH cluster through the relays."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.jobs import CLI, REMOTE_JOBS, REPO, job_processes, wait_for

from testbed import TestBed
from testbed.slurm import SlurmCluster

pytestmark = [pytest.mark.testbed, pytest.mark.slow]


@pytest.fixture
def slurm_cli(cli: CLI, slurm_bed: TestBed) -> Iterator[CLI]:
    """The CLI with the bed's ssh_config and known_hosts; remote job dirs removed after."""
    cli.env["NEBULA_SSH_CONFIG"] = str(slurm_bed.ssh_config)
    cli.env["NEBULA_KNOWN_HOSTS"] = str(slurm_bed.known_hosts)
    yield cli
    for job_id in cli.job_ids():  # the cli fixture stops the jobs; their files go here
        shutil.rmtree(REMOTE_JOBS / job_id, ignore_errors=True)


def slurm_of(bed: TestBed) -> SlurmCluster:
    assert bed.slurm is not None
    return bed.slurm


def slurm_spec(tmp_path: Path, *, steps: int, slurm: dict[str, Any] | None = None,
               with_ssh: bool = True, checkpoint: dict[str, Any] | None = None,
               model: str = "", **hpc: Any) -> Path:
    quick = yaml.safe_load((REPO / "templates" / "quickstart.yaml").read_text())
    relay = quick["relay"]
    relay["sync"]["inner_steps"] = 10
    relay["shaping"] = {"rate_mbit": None, "delay_ms": 10}
    clusters: list[dict[str, Any]] = [{
        "name": "hpc", "scheduler": "slurm", "python": sys.executable, **hpc,
        "hosts": [{"host": "login"}],
        "slurm": {"nodes": 2, "ntasks_per_node": 1, "time": "00:20:00", **(slurm or {})}}]
    if with_ssh:
        clusters.append({"name": "east", "python": sys.executable, "hosts": [{"host": "e1"}]})
    spec: dict[str, Any] = {
        "name": "slurmjob", "workdir": str(REPO / "examples" / "gpt"),
        "run": f"python -u train.py --steps {steps} --eval-every 10 --log-every 5 {model}".strip(),
        "deepspeed": "ds_config.json", "env": {"OMP_NUM_THREADS": "1"},
        "clusters": clusters, "relay": relay, "grace": 20.0}
    if checkpoint:
        spec["checkpoint"] = checkpoint
    path = tmp_path / "slurm.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def records(job_id: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted((REMOTE_JOBS / job_id).glob("*/*/worker/metrics/*.jsonl")):
        out += [json.loads(x) for x in path.read_text().splitlines() if x]
    return out


def status(cli: CLI, job_id: str) -> dict[str, Any]:
    return json.loads(cli("status", job_id, "--json", check=True).stdout)


@pytest.mark.timeout(600)
def test_slurm_and_ssh_clusters_train_one_model(slurm_cli: CLI, slurm_bed: TestBed,
                                                tmp_path: Path) -> None:
    """REALWORLD Slurm: two ranks per node (one per GPU at a site), `cpus_per_task`, and a job
    that asks for every CPU of its nodes (2 x 4 of the bed's 8). A tiny model: five DeepSpeed
    processes share the machine."""
    spec = slurm_spec(tmp_path, steps=20, slurm={"ntasks_per_node": 2, "cpus_per_task": 4},
                      model="--d-model 32 --n-layer 1 --n-head 2 --context 32")
    proc = slurm_cli("launch", str(spec), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job_id,) = slurm_cli.job_ids()
    assert "submitted Slurm job" in proc.stderr and "runs on c1, c2" in proc.stderr
    assert "all 5 workers hold identical parameters" in proc.stdout
    finals = [r for r in records(job_id) if r.get("final")]
    # every rank ran once, where the spec put it: 2 per node, one world of 4 on the nodes
    ranks = sorted((r["cluster"], r["host"], r["rank"], r["local_rank"], r["world_size"])
                   for r in finals)
    assert ranks == [("east", "e1", 0, 0, 1), ("hpc", "c1", 0, 0, 4), ("hpc", "c1", 1, 1, 4),
                     ("hpc", "c2", 2, 0, 4), ("hpc", "c2", 3, 1, 4)], ranks
    assert len({r["param_sha256"] for r in finals}) == 1
    rounds = [r for r in records(job_id) if r.get("outer_round") is not None]
    assert rounds and all(r["clusters_present"] == 2 for r in rounds)
    st = status(slurm_cli, job_id)
    assert st["state"] == "SUCCEEDED"
    # the agents ended, so did the keepers: the Slurm job left the queue by itself
    wait_for(lambda: not slurm_of(slurm_bed).active_jobs(), timeout=60)
    assert job_processes(job_id) == []


def test_queued_job_shows_slurms_reason_and_ctrl_c_cancels_it(
        slurm_cli: CLI, slurm_bed: TestBed, tmp_path: Path) -> None:
    spec = slurm_spec(tmp_path, steps=20, with_ssh=False,
                      slurm={"sbatch_args": ["--begin=now+3600"]})
    launch = subprocess.Popen([sys.executable, "-m", "nebula_cli", "launch", str(spec)],
                              env=slurm_cli.env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        job_id = wait_for(lambda: (slurm_cli.job_ids() or [None])[0], timeout=60)
        st = wait_for(lambda: (s := status(slurm_cli, job_id))["state"] == "QUEUED" and s,
                      timeout=120)
        assert "BeginTime" in st["reason"], st
        (active,) = slurm_of(slurm_bed).active_jobs()
        assert active[1] == "PENDING" and active[2] == f"nebula-{job_id}-hpc"
        launch.send_signal(signal.SIGINT)
        out, err = launch.communicate(timeout=120)
    finally:
        launch.kill()
    assert launch.returncode == 130, out + err
    assert status(slurm_cli, job_id)["state"] == "CANCELLED"
    assert slurm_of(slurm_bed).active_jobs() == []


@pytest.mark.timeout(600)
def test_relay_on_login_behind_a_tunnel_and_stop_mid_run_leave_nothing(
        slurm_cli: CLI, slurm_bed: TestBed, tmp_path: Path) -> None:
    """Two ranks per node (REALWORLD Slurm: several ranks per node): `stop` mid-run ends
    every one and leaves the queue empty."""
    keys = slurm_bed.authorized_keys("login")  # on the "shared home": the bed's own file
    spec = slurm_spec(tmp_path, steps=100_000, relay_on="login", relay_reach="ssh",
                      authorized_keys=str(keys), slurm={"ntasks_per_node": 2},
                      model="--d-model 32 --n-layer 1 --n-head 2 --context 32")
    slurm_cli("launch", "--detach", str(spec), check=True, timeout=600)
    (job_id,) = slurm_cli.job_ids()
    # the login node's relay joins the nodes' workers and, through east's SSH tunnel to the
    # login node, the SSH cluster's relay in rounds
    wait_for(lambda: any(r.get("clusters_present") == 2 and r["cluster"] == "hpc"
                         for r in records(job_id)), timeout=400, every=2)
    hosts = {(h["cluster"], h["role"]): h["host"] for h in status(slurm_cli, job_id)["hosts"]}
    assert hosts[("hpc", "relay")] == "login" and hosts[("hpc", "worker")] in ("c1", "c2")
    assert f"nebula-tunnel:{job_id}:east>hpc" in keys.read_text()
    relay_log = REMOTE_JOBS / job_id / "east" / "e1" / "relay" / "logs" / "relay.log"
    assert re.search(r"tunnel to hpc up: \S+/tunnels/hpc\.sock", relay_log.read_text())
    (active,) = slurm_of(slurm_bed).active_jobs()
    assert active[1] == "RUNNING"
    out = slurm_cli("stop", job_id, check=True, timeout=300)
    assert f"Slurm job {active[0]}" in out.stdout, out.stdout
    # stop returns once Slurm says the allocation ended, and says so: the keepers left on
    # their SIGTERM, Slurm did not wait its KillWait to kill them
    assert f"cancelled hpc: Slurm job {active[0]} CANCELLED, ended " in out.stdout, out.stdout
    assert not slurm_of(slurm_bed).active_jobs()
    assert status(slurm_cli, job_id)["state"] == "STOPPED"
    # every rank stopped gracefully, each once, where the spec put it
    ranks = sorted((r["host"], r["rank"], r["local_rank"], r["world_size"])
                   for r in records(job_id) if r["cluster"] == "hpc" and r.get("final"))
    assert ranks == [("c1", 0, 0, 4), ("c1", 1, 1, 4), ("c2", 2, 0, 4), ("c2", 3, 1, 4)], ranks
    wait_for(lambda: not slurm_of(slurm_bed).active_jobs(), timeout=60)
    assert job_processes(job_id) == []  # the login node's relay and the tunnel too
    assert "nebula-tunnel" not in keys.read_text()


def test_slurm_refusal_names_the_spec_field_and_nothing_is_submitted(
        slurm_cli: CLI, slurm_bed: TestBed, tmp_path: Path) -> None:
    spec = slurm_spec(tmp_path, steps=20, with_ssh=False, slurm={"partition": "nope"})
    out = slurm_cli("launch", "--detach", str(spec), timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    line = next(i for i, t in enumerate(spec.read_text().splitlines(), 1) if "nope" in t)
    assert f"{spec}:{line}:" in out.stderr and "clusters[0].slurm.partition" in out.stderr
    assert "partition" in out.stderr.lower() and "refuses" in out.stderr
    assert slurm_of(slurm_bed).active_jobs() == []
    assert "submitted" not in out.stderr
    (job_id,) = slurm_cli.job_ids()  # nothing was queued: Slurm's job log never saw it
    log = slurm_of(slurm_bed).jobcomp_log
    assert not log.exists() or f"nebula-{job_id}" not in log.read_text()


@pytest.mark.timeout(600)  # Slurm's own minutes: a 3-minute limit, then a resume
def test_time_limit_is_shown_as_timeout_and_resume_continues_from_the_checkpoint(
        slurm_cli: CLI, slurm_bed: TestBed, tmp_path: Path) -> None:
    # Slurm's notice comes 60 s before the 3-minute limit (up to a minute earlier: Slurm checks
    # about once a minute): the workers stop and checkpoint, then Slurm ends the job TIMEOUT.
    # (A 2-minute limit left a loaded machine's workers no checkpoint before the notice.)
    spec = slurm_spec(tmp_path, steps=100_000, with_ssh=False, checkpoint={"every": 5},
                      slurm={"time": "3", "sbatch_args": ["--signal=TERM@60"]},
                      model="--d-model 32 --n-layer 1 --n-head 2 --context 32")
    slurm_cli("launch", "--detach", str(spec), check=True, timeout=600)
    (job_id,) = slurm_cli.job_ids()
    (first,) = slurm_of(slurm_bed).active_jobs()
    st = wait_for(lambda: (s := status(slurm_cli, job_id))["state"] != "RUNNING" and s,
                  timeout=400, every=2)
    outputs = "".join(p.read_text() for p in (REMOTE_JOBS / job_id / "slurm").glob("*.out"))
    assert st["state"] == "FAILED" and f"Slurm job {first[0]} TIMEOUT" in st["reason"], \
        (st, outputs)
    saved = sorted((REMOTE_JOBS / job_id / "checkpoints" / "hpc").glob("node*/step*/COMPLETE"))
    assert {p.parent.parent.name for p in saved} == {"node0", "node1"}, saved
    steps_done = max(int(p.parent.name.removeprefix("step")) for p in saved)

    out = slurm_cli("resume", job_id, "--detach", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    (second,) = slurm_of(slurm_bed).active_jobs()
    assert second[0] != first[0]
    resumed = wait_for(lambda: [r for r in records(job_id) if r.get("resumed_from_step")],
                       timeout=300)
    assert {r["resumed_from_step"] for r in resumed} == {steps_done}
    assert slurm_cli("stop", job_id, timeout=300).returncode == 0
    wait_for(lambda: not slurm_of(slurm_bed).active_jobs(), timeout=60)
    assert job_processes(job_id) == []


def test_validate_hosts_says_what_slurm_would_do_and_submits_nothing(
        slurm_cli: CLI, slurm_bed: TestBed, tmp_path: Path) -> None:
    spec = slurm_spec(tmp_path, steps=20, with_ssh=False,
                      slurm={"ntasks_per_node": 4, "gpus_per_node": 4})
    out = slurm_cli("validate", "--hosts", str(spec), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    said = " ".join(out.stdout.split())
    assert "hpc/login: Slurm on login: Job " in said and "on nodes c[1-2]" in said, said
    assert "using 8 processors" in said, said
    # a time over the partition's limit: Slurm's words, at the spec's line
    over = slurm_spec(tmp_path, steps=20, with_ssh=False,
                      slurm={"partition": "short", "time": "00:10:00"})
    out = slurm_cli("validate", "--hosts", str(over), timeout=300)
    line = next(i for i, t in enumerate(over.read_text().splitlines(), 1) if "00:10:00" in t)
    assert out.returncode != 0 and f"{over}:{line}:" in out.stderr, out.stdout + out.stderr
    assert "clusters[0].slurm.time" in out.stderr and "time limit" in out.stderr
    assert slurm_of(slurm_bed).active_jobs() == [] and slurm_cli.job_ids() == []
