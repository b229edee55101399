"""The transport kinds by name: what the state store kept (before typed connections too) reads
back typed and is written again unchanged; the spec's transports are the spec kinds."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from nebula_cli.config.cluster import ClusterSpec
from nebula_cli.errors import UsageError
from nebula_cli.schedulers.slurm.node_conn import SlurmNodeConn
from nebula_cli.transport.local.conn import LocalConn
from nebula_cli.transport.registry import KINDS, SPEC_KINDS, conn_from_data, describe
from nebula_cli.transport.ssh.conn import SshConn

# what earlier versions of nebula recorded (transport.describe, slurm_node, conn_of), verbatim
STORED_LOCAL = {"transport": "local", "name": "e1", "home": "/home/me/.nebula",
                "python": "/usr/bin/python3"}
STORED_SSH = {"transport": "ssh", "name": "w1", "host": "w1.example", "user": "jdoe",
              "port": 2222, "key": None, "jump": "bastion", "python": "python3",
              "pythonpath": "/home/jdoe/.nebula/jobs/j/lib"}
STORED_SSH_TOOLS = {"transport": "ssh", "name": "w1", "host": "127.0.0.1", "port": 22,
                    "user": "nobody", "python": "python3", "known_hosts": "/k/known_hosts",
                    "connect_timeout": 3}
STORED_NODE = {"transport": "slurm-node", "name": "n1",
               "login": {"transport": "ssh", "name": "login", "host": "login", "user": None,
                         "port": None, "key": None, "jump": None, "python": "python3"},
               "job": "12", "node": "n1", "address": "10.1.0.1", "keeper": "12",
               "python": "python3", "pythonpath": "/home/u/.nebula/jobs/j/lib"}


@pytest.mark.parametrize("stored, kind", [
    (STORED_LOCAL, LocalConn), (STORED_SSH, SshConn), (STORED_NODE, SlurmNodeConn)])
def test_what_earlier_versions_stored_reads_back_typed_and_unchanged(
        stored: dict[str, Any], kind: type) -> None:
    conn = conn_from_data(stored)
    assert type(conn) is kind and conn.kind == stored["transport"]
    assert conn.name == stored["name"] and conn.python == stored["python"]
    assert conn.to_data() == stored
    assert list(conn.to_data()) == list(stored)  # the same keys in the same order
    assert conn_from_data(conn.to_data()) == conn


def test_keys_tools_set_are_kept() -> None:
    conn = conn_from_data(STORED_SSH_TOOLS)
    assert isinstance(conn, SshConn)
    assert (conn.known_hosts, conn.connect_timeout, conn.key) == ("/k/known_hosts", 3, None)
    assert {k: v for k, v in conn.to_data().items() if v is not None} == STORED_SSH_TOOLS


def test_a_slurm_nodes_login_node_is_read_with_its_own_kind() -> None:
    conn = conn_from_data(STORED_NODE)
    assert isinstance(conn, SlurmNodeConn) and isinstance(conn.login, SshConn)
    assert conn.through == conn.login and conn.in_allocation and not conn.login.in_allocation


@pytest.mark.parametrize("kind", ["kubernetes", None, 3])
def test_an_unknown_kind_is_refused_by_name(kind: object) -> None:
    with pytest.raises(UsageError, match=f"transport '{kind}' is not available"):
        conn_from_data({"transport": kind, "name": "x"})
    if isinstance(kind, str):
        with pytest.raises(UsageError, match=f"transport '{kind}' is not available"):
            describe(kind, name="x", home="/h", python="python3")


def test_the_spec_names_exactly_the_spec_kinds() -> None:
    (spec_kinds,) = [typing.get_args(ClusterSpec.model_fields["transport"].annotation)]
    assert set(spec_kinds) == set(SPEC_KINDS) and set(SPEC_KINDS) < set(KINDS)
    assert all(KINDS[name].kind == name for name in KINDS)


def test_describe_makes_what_the_spec_says() -> None:
    ssh = describe("ssh", name="w1", home="/ignored", user="jdoe", port=2222, key="~/.ssh/k",
                   jump="bastion", python="/opt/py/bin/python3")
    assert ssh == SshConn(name="w1", host="w1", user="jdoe", port=2222, key="~/.ssh/k",
                          jump="bastion", python="/opt/py/bin/python3")
    assert ssh.to_data() == {"transport": "ssh", "name": "w1", "host": "w1", "user": "jdoe",
                             "port": 2222, "key": "~/.ssh/k", "jump": "bastion",
                             "python": "/opt/py/bin/python3"}
    local = describe("local", name="e1", home="/home/me/.nebula", host="ignored",
                     python="/opt/py/bin/python3")
    assert local == LocalConn(name="e1", home="/home/me/.nebula", python="/opt/py/bin/python3")
