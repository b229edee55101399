"""The test bed's Slurm cluster: real slurmctld/slurmd, jobs submitted through SSH to the login
node as a user would (sbatch, squeue, srun, scancel); compute nodes have no SSH."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.jobs import wait_for

from testbed import TestBed
from testbed.slurm import SlurmCluster

pytestmark = pytest.mark.testbed

FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def login(bed: TestBed, command: str, *, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a shell command on the login node through SSH."""
    return subprocess.run(bed.ssh_argv("login", command), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def slurm_of(bed: TestBed) -> SlurmCluster:
    assert bed.slurm is not None
    return bed.slurm


@pytest.fixture
def jobs(slurm_bed: TestBed) -> Iterator[list[str]]:
    """Ids of the jobs a test submits: every one is cancelled (and waited for) at the end."""
    submitted: list[str] = []
    yield submitted
    slurm_of(slurm_bed).cancel(*submitted)


def sbatch(bed: TestBed, jobs: list[str], tmp_path: Path, options: str, script: str) -> str:
    """Submit `script` from the login node with `options`; its id (recorded in `jobs`)."""
    path = tmp_path / f"job{len(jobs)}.sh"
    path.write_text("#!/bin/sh\n" + script)
    out = login(bed, f"sbatch --parsable --chdir={tmp_path} -o {tmp_path}/%j.out {options} "
                     f"{path}")
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    assert job_id.isdigit(), out.stdout
    jobs.append(job_id)
    return job_id


def test_login_node_reaches_the_beds_own_controller(slurm_bed: TestBed) -> None:
    bed, slurm = slurm_bed, slurm_of(slurm_bed)
    assert set(slurm.nodes) == {"c1", "c2"} and slurm.login.name == "login"
    assert set(slurm.partitions) == {"debug", "short"}
    out = login(bed, "echo $SLURM_CONF; scontrol show config | grep -E '^(ClusterName|AuthInfo)'; "
                     "sinfo -h -N -o '%N %t %P'")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == str(slurm.conf) and str(slurm.conf).startswith(str(bed.dir))
    assert re.search(rf"ClusterName\s*=\s*{bed.id}$", out.stdout, re.M)
    assert f"socket={slurm.munge_socket}" in out.stdout  # the bed's munged, not /run/munge
    assert sorted(lines[-4:]) == ["c1 idle debug*", "c1 idle short", "c2 idle debug*",
                                  "c2 idle short"]
    # Compute nodes run slurmd but no sshd, and the ssh_config does not know them.
    for node in slurm.nodes.values():
        assert node.name not in bed.hosts and not node.sshd
        listening = bed.run(node.name, ["ss", "-Hltn"], check=True).stdout
        assert f":{slurm.slurmd_port} " in listening and ":22 " not in listening
        assert f"Host {node.name}\n" not in bed.ssh_config.read_text()


def test_batch_job_runs_srun_on_both_nodes(slurm_bed: TestBed, jobs: list[str],
                                           tmp_path: Path) -> None:
    bed, slurm = slurm_bed, slurm_of(slurm_bed)
    # --overlap, as nebula's own steps: without it the second step waits until slurmctld has
    # released the first one's CPUs, and an srun told "Requested nodes are busy" whose wake-up
    # comes before it listens sleeps max(60, SlurmctldTimeout) + pid % 10 seconds
    # (srun/launch.c), longer than this test waits (seen once in CI).
    job = sbatch(bed, jobs, tmp_path, "-N2 --ntasks-per-node=1",
                 'echo "batch on $SLURMD_NODENAME"\n'
                 "srun --overlap hostname -I\n"
                 "srun --overlap sh -c 'echo task $SLURM_PROCID on $SLURMD_NODENAME'\n")
    output = tmp_path / f"{job}.out"
    assert slurm.wait_state(job, FINISHED, said=output) == "COMPLETED"
    output = output.read_text()
    addresses = {n.address for n in slurm.nodes.values()}
    assert addresses <= set(output.split()), output
    assert "task 0 on c1" in output and "task 1 on c2" in output
    assert "batch on c1" in output
    state = login(bed, f"squeue -h -t all -j {job} -o '%i|%T|%r|%N'")
    assert state.stdout.strip() == f"{job}|COMPLETED|None|c[1-2]"
    # Without slurmdbd, sacct answers from the job completion log (-c) only.
    acct = login(bed, f"sacct -c -n -P -j {job} -o JobID,State,ExitCode")
    assert acct.stdout.strip() == f"{job}|COMPLETED|0:0", acct.stdout + acct.stderr


def test_begin_time_job_is_pending_with_reason_begin_time(slurm_bed: TestBed, jobs: list[str],
                                                          tmp_path: Path) -> None:
    job = sbatch(slurm_bed, jobs, tmp_path, "--begin=now+1hour", "true\n")
    out = login(slurm_bed, f"squeue -h -o '%T %r' -j {job}")
    assert out.stdout.strip() == "PENDING BeginTime", out.stdout + out.stderr
    assert any(j == job for j, _, _ in slurm_of(slurm_bed).active_jobs())
    cancelled = login(slurm_bed, f"scancel {job}")
    assert cancelled.returncode == 0 and cancelled.stdout == "", cancelled.stderr
    assert slurm_of(slurm_bed).wait_state(job, FINISHED) == "CANCELLED"


def test_job_over_the_partition_time_limit_is_rejected(slurm_bed: TestBed,
                                                       tmp_path: Path) -> None:
    script = tmp_path / "never.sh"
    script.write_text("#!/bin/sh\ntrue\n")
    out = login(slurm_bed, f"sbatch --parsable -p short --time=00:10:00 {shlex.quote(str(script))}")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == ("sbatch: error: Batch job submission failed: Requested time "
                                  "limit is invalid (missing or exceeds some limit)")
    assert slurm_of(slurm_bed).active_jobs() == []


def test_srun_from_the_login_node_into_a_running_allocation(slurm_bed: TestBed,
                                                            jobs: list[str],
                                                            tmp_path: Path) -> None:
    bed, slurm = slurm_bed, slurm_of(slurm_bed)
    job = sbatch(bed, jobs, tmp_path, "-N2 --ntasks-per-node=1 --time=00:05:00",
                 "srun sleep 300\n")
    slurm.wait_state(job, ("RUNNING",))
    out = login(bed, f"srun --jobid {job} --overlap -w c2 -N1 -n1 "
                     "sh -c 'echo $SLURM_JOB_ID $SLURMD_NODENAME $(hostname -I)'")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [job, "c2", slurm.nodes["c2"].address]
    cancelled = login(bed, f"scancel {job}")
    assert cancelled.returncode == 0, cancelled.stderr
    assert slurm.wait_state(job, FINISHED) == "CANCELLED"


def test_jobs_left_running_are_leaks_and_reset_cancels_them(slurm_bed: TestBed,
                                                            tmp_path: Path) -> None:
    bed, slurm = slurm_bed, slurm_of(slurm_bed)
    out = slurm.client("sbatch", "--parsable", f"--chdir={tmp_path}", "-o", "/dev/null",
                       "--wrap", "sleep 300")
    job = out.stdout.strip()
    try:
        slurm.wait_state(job, ("RUNNING",))
        leaks = bed.leaks()
        assert f"slurm job {job} (wrap) RUNNING" in leaks
        assert any("slurmstepd" in leak for leak in leaks)  # its processes on c1
        bed.reset()
        assert bed.leaks() == []
        assert slurm.job_state(job) == "CANCELLED"
        assert all(p is not None for p in slurm.daemon_pids().values())
    finally:
        slurm.cancel(job)


def _slurm_processes(bed_id: str) -> list[str]:
    """Slurm and munge processes of one bed: in its namespaces, or naming its slurm dir."""
    from testbed.system import _cmdline, list_namespaces, namespace_pids

    pids = {p for ns in list_namespaces() if ns.startswith(f"{bed_id}-")
            for p in namespace_pids(ns)}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if f"/{bed_id}/slurm/".encode() in entry.joinpath("cmdline").read_bytes():
                pids.add(int(entry.name))
        except OSError:
            continue
    names = [_cmdline(p) for p in pids if Path(f"/proc/{p}").exists()]
    return [n for n in names if re.match(r"(slurm|munged|/usr/sbin/(slurm|munged))", n)]


def _with_a_step(bed_id: str) -> str:
    """The bed's Slurm processes' command lines, once a slurmstepd is among them ("" before)."""
    running = " ".join(_slurm_processes(bed_id))
    return running if "slurmstepd" in running else ""


def test_down_and_cleanup_stale_end_every_slurm_process(make_testbed, tmp_path: Path) -> None:
    import json

    from testbed import cleanup_stale
    from testbed.registry import STATE_ROOT

    ok, reason = TestBed.slurm_available()
    if not ok:
        pytest.skip(f"Slurm unavailable: {reason}")
    for ending in ("down", "stale"):
        bed = make_testbed({"h": ["hl", "hc1"]}, rate_mbit=None, bastion=False,
                           slurm={"h": "hl"})
        slurm = slurm_of(bed)
        job = slurm.client("sbatch", "--parsable", f"--chdir={tmp_path}", "-o", "/dev/null",
                           "--wrap", "sleep 300").stdout.strip()
        slurm.wait_state(job, ("RUNNING",))
        # RUNNING once slurmctld dispatched it: the node's slurmstepd follows
        running = wait_for(lambda b=bed.id: _with_a_step(b), timeout=30)
        for name in ("munged", "slurmctld", "slurmd", "slurmstepd"):
            assert name in running
        if ending == "down":
            bed.down()
        else:  # its creator is gone: the next session's cleanup_stale() ends it
            state_file = STATE_ROOT / bed.id / "state.json"
            dead = subprocess.Popen(["true"])
            dead.wait()
            state_file.write_text(json.dumps({**json.loads(state_file.read_text()),
                                              "pid": dead.pid}))
            assert bed.id in cleanup_stale()
        assert _slurm_processes(bed.id) == []
        assert not bed.dir.exists()
