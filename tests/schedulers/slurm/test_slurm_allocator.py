"""`SlurmAllocator` apart from Slurm itself (tests/testbed/test_slurm_launch.py submits real jobs):
what it calls an allocation and its states, the login node's missing tools, and a cancel whose
job does not end (tests/scheduler/test_slurm_batch_shapes.py cancels real ones)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nebula_cli.errors import LaunchError
from nebula_cli.scheduler.allocation import Allocation
from nebula_cli.schedulers.slurm import allocator as slurm_mod
from nebula_cli.schedulers.slurm.allocator import SlurmAllocator, keeper_name, output_path
from nebula_cli.transport import LocalTransport
from nebula_cli.transport.ssh.conn import SshConn

ALLOC = Allocation(cluster="hpc", login=SshConn(name="login", python="python3"), job="12",
                   job_root="/r", nodes={"n1": "10.1.0.1"})


def test_names_and_places_of_a_slurm_job() -> None:
    slurm = SlurmAllocator()
    assert slurm.label(ALLOC) == "Slurm job 12" and keeper_name(ALLOC) == "12"
    assert output_path(ALLOC) == "/r/slurm/hpc-12.out"  # schedulers/slurm/slurm.sbatch's --output
    node = slurm.node_conn(ALLOC, "n1")
    assert node.name == "n1" and node.python == "python3" and node.pythonpath == "/r/lib"


def test_a_login_node_without_slurms_tools_is_named(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing of Slurm's there
    t = LocalTransport("login", home=str(tmp_path))
    with pytest.raises(LaunchError, match="login: sbatch, squeue, scancel, scontrol, srun not"):
        SlurmAllocator().check_host(t)


def test_cancel_waits_for_the_end_bounded_and_says_when_slurm_has_not_ended_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that stays COMPLETING (a node that does not answer): `cancel` (and so `stop`)
    returns after `CANCEL_WAIT`, saying so. Slurm's tools here are scripts on the PATH: scancel
    notes its call, squeue says COMPLETING."""
    calls = tmp_path / "calls"
    for tool, says in (("scancel", ""), ("squeue", "COMPLETING|None|n1")):
        script = tmp_path / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\necho "{says}"\n')
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(slurm_mod, "CANCEL_WAIT", 1.0)
    t = LocalTransport("login", home=str(tmp_path))
    said = SlurmAllocator().cancel(t, ALLOC)
    assert not said.ended
    assert said.said == ("Slurm job 12 still COMPLETING 1 s after scancel (nebula waited no "
                         "longer: Slurm ends it)")
    lines = calls.read_text().splitlines()
    assert lines[0] == "scancel 12" and len(lines) > 2 and all(
        line.startswith("squeue -h -t all -j 12") for line in lines[1:]), lines
