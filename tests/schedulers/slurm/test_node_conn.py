"""`SlurmNodeConn`: a node of an allocation, its commands run as ``srun`` steps from the login
node's transport, which every node shares. Here the login node is this machine and `srun` a
stand-in that runs the step's command (tests/testbed/test_slurm_launch.py runs the real one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nebula_cli.schedulers.slurm.node_conn import SlurmNodeConn
from nebula_cli.schedulers.slurm.node_transport import SlurmNodeTransport
from nebula_cli.transport import LocalTransport
from nebula_cli.transport.local.conn import LocalConn

SRUN = """#!/bin/sh
# the step's options, as nebula passes them, then the command
echo "$@" > "$STEP_SEEN"
env | grep -E '^(SLURM|SRUN|SALLOC)_' | sort > "$STEP_SEEN.env"
while [ $# -gt 0 ]; do case "$1" in --*) shift ;; *) break ;; esac; done
exec "$@"
"""


@pytest.fixture
def login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalConn:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("STEP_SEEN", str(tmp_path / "seen"))
    return LocalConn(name="login", home=str(tmp_path / "home"), python="python3")


def node_of(login: LocalConn) -> SlurmNodeConn:
    return SlurmNodeConn(name="n1", login=login, job="12", node="n1", address="10.1.0.1",
                         keeper="12", python="python3", pythonpath="/h/jobs/j/lib")


def test_commands_run_as_steps_through_the_login_nodes_transport(
        login: LocalConn, tmp_path: Path) -> None:
    conn = node_of(login)
    shared = login.open()
    t = conn.open(through=shared)
    assert isinstance(t, SlurmNodeTransport) and t.login is shared  # one connection for all
    assert (t.name, t.address, t.home) == ("n1", "10.1.0.1", shared.home)
    result = t.run(["/bin/sh", "-c", "echo on the node"], timeout=30)
    assert result.ok and result.stdout.strip() == "on the node"
    seen = (tmp_path / "seen").read_text().split()
    assert seen[:5] == ["--jobid=12", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n1"]


def test_a_login_shell_inside_an_allocation_does_not_reshape_the_steps(
        login: LocalConn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """REALWORLD Slurm: nebula run from a shell of an interactive job (`salloc -n 4 -c 2`),
    whose SLURM_* variables srun would take as its own options."""
    for name, value in {"SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_NTASKS_PER_NODE": "4",
                        "SLURM_CPUS_PER_TASK": "2", "SRUN_CPUS_PER_TASK": "2",
                        "SLURM_JOB_ID": "99", "SALLOC_PARTITION": "x",
                        "SLURM_CONF": "/etc/site/slurm.conf"}.items():
        monkeypatch.setenv(name, value)
    t = node_of(login).open()
    assert t.run(["true"], timeout=30).ok
    assert (tmp_path / "seen.env").read_text().split() == ["SLURM_CONF=/etc/site/slurm.conf"]
    assert (tmp_path / "seen").read_text().split()[:4] == [
        "--jobid=12", "--overlap", "--nodes=1", "--ntasks=1"]


def test_without_a_shared_login_transport_it_opens_its_own(login: LocalConn) -> None:
    t = node_of(login).open()
    assert isinstance(t, SlurmNodeTransport) and isinstance(t.login, LocalTransport)
    assert t.pythonpath == "/h/jobs/j/lib" and t.keeper == "12"
