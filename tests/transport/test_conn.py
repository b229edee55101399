"""`Conn`, what every kind shares: frozen, equal by value, one machine key per machine, a
pythonpath added without changing the kind."""

from __future__ import annotations

import dataclasses

import pytest

from nebula_cli.schedulers.slurm.node_conn import SlurmNodeConn
from nebula_cli.transport.conn import Conn
from nebula_cli.transport.local.conn import LocalConn
from nebula_cli.transport.ssh.conn import SshConn

LOGIN = SshConn(name="login", host="login.example", user="jdoe", python="python3")


def node(name: str, job: str = "12") -> SlurmNodeConn:
    return SlurmNodeConn(name=name, login=LOGIN, job=job, node=name, address=f"{name}.ib",
                         keeper=job, python="python3")


@pytest.mark.parametrize("conn", [
    LocalConn(name="e1", home="/h", python="python3"), LOGIN, node("n1")])
def test_with_pythonpath_keeps_the_kind_and_everything_else(conn: Conn) -> None:
    moved = conn.with_pythonpath("/h/jobs/j/lib")
    assert type(moved) is type(conn) and moved.pythonpath == "/h/jobs/j/lib"
    assert dataclasses.replace(moved, pythonpath=conn.pythonpath) == conn
    assert moved.to_data()["pythonpath"] == "/h/jobs/j/lib"
    assert moved.machine_key() == conn.machine_key()  # the same machine
    with pytest.raises(dataclasses.FrozenInstanceError):
        conn.name = "elsewhere"  # type: ignore[misc]
    assert hash(conn) == hash(dataclasses.replace(conn))


def test_hosts_of_one_machine_share_a_key_others_do_not() -> None:
    a, b = LocalConn(name="e1", home="/h", python="p"), LocalConn(name="w1", home="/h",
                                                                  python="p")
    assert a.machine_key() == b.machine_key() and a != b  # two hosts, this one machine
    assert SshConn(name="w1", host="h", python="p").machine_key() != SshConn(
        name="w1", host="h", port=2222, python="p").machine_key()
    assert node("n1").machine_key() != node("n2").machine_key()
    assert node("n1").machine_key() != node("n1", job="13").machine_key()
    assert node("n1").machine_key()[-len(LOGIN.machine_key()):] == LOGIN.machine_key()


def test_only_a_node_of_an_allocation_is_reached_through_another_host() -> None:
    assert LOGIN.through is None and not LOGIN.in_allocation
    assert node("n1").through is LOGIN and node("n1").in_allocation
