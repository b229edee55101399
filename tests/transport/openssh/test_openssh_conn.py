"""`OpensshConn` (`transport: openssh`): the user's own `ssh` over a master connection. Its
description is plain data the state store keeps and reads back; opening it connects nothing
(the master starts on first use: tests/test_transport_contract.py holds the transport to the
contract against a real sshd); a spec names it like `ssh`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.jobs import write_spec

from nebula_cli.config.spec import load_spec
from nebula_cli.transport.openssh.conn import OpensshConn
from nebula_cli.transport.openssh.transport import CONTROL_DIR, OpenSSHTransport
from nebula_cli.transport.registry import conn_from_data, describe

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's client")


def test_it_opens_the_openssh_transport_and_connects_nothing(tmp_path: Path) -> None:
    conn = OpensshConn(name="w1", host="127.0.0.1", user="nobody", port=2222,
                       python="python3", known_hosts="/k/known_hosts", connect_timeout=3,
                       ssh_config=str(tmp_path / "none"), control_dir="/tmp/nc-x")
    with conn.open() as t:
        assert isinstance(t, OpenSSHTransport) and t.name == "w1" and t.python == "python3"
        assert (t.target.user, t.target.hostname, t.target.port) == ("nobody", "127.0.0.1",
                                                                      2222)
        assert t.control_path == "/tmp/nc-x/%C" and t.connect_timeout == 3.0
        argv = t._options()
        assert "StrictHostKeyChecking=yes" in argv and "UserKnownHostsFile=/k/known_hosts" in argv
    with OpensshConn(name="w1", python="python3").open(accept_new_host_keys=True) as t:
        assert "StrictHostKeyChecking=accept-new" in t._options()
        assert t.control_path.startswith(str(Path(CONTROL_DIR).expanduser()))


def test_its_data_round_trips_through_the_registry() -> None:
    conn = describe("openssh", name="w1", home="/unused", host="gpu1", user="u", port=22,
                    key=None, jump="bastion", python="python3")
    assert isinstance(conn, OpensshConn) and conn.machine_key() == (
        "openssh", "u", "gpu1", 22, "bastion")
    data = conn.to_data()
    assert data == {"transport": "openssh", "name": "w1", "host": "gpu1", "user": "u",
                    "port": 22, "key": None, "jump": "bastion", "python": "python3"}
    assert conn_from_data(data) == conn
    assert conn_from_data({**data, "control_dir": "/c"}).control_dir == "/c"


def test_a_spec_names_it_and_its_hosts_are_ssh_hosts(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, """\
        name: otp
        run: echo hi
        clusters:
          - name: hpc
            transport: openssh
            relay_reach: ssh
            hosts: [login1]
          - name: lab
            hosts: [gpu1]
        """))
    assert spec.clusters[0].transport == "openssh" and spec.clusters[0].over_ssh
