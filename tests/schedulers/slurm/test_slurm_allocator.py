"""`SlurmAllocator` apart from Slurm itself (tests/testbed/test_slurm_launch.py submits real jobs):
what it calls an allocation and its states, and the login node's missing tools."""

from __future__ import annotations

from pathlib import Path

import pytest

from nebula_cli.errors import LaunchError
from nebula_cli.scheduler.allocation import Allocation
from nebula_cli.schedulers.slurm.allocator import SlurmAllocator, keeper_name, output_path
from nebula_cli.transport import LocalTransport
from nebula_cli.transport.ssh_conn import SshConn

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
