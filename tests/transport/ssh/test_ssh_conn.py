"""`SshConn`: a host over SSH. Opening it connects nothing yet (paramiko connects on first use;
tests/testbed/test_ssh_launch.py and tests/e2e/test_cheap_reads.py reach real sshds through it),
and what tools set (known_hosts, a timeout, accepting new host keys) reaches the transport."""

from __future__ import annotations

from nebula_cli.transport.ssh.conn import SshConn
from nebula_cli.transport.ssh.transport import CONNECT_TIMEOUT, SSHTransport


def test_it_opens_an_ssh_transport_with_what_it_says_and_connects_nothing() -> None:
    conn = SshConn(name="w1", host="127.0.0.1", user="nobody", port=2222, python="python3",
                   known_hosts="/k/known_hosts", connect_timeout=3)
    with conn.open() as t:
        assert isinstance(t, SSHTransport) and t.name == "w1" and t.python == "python3"
        assert (t.target.user, t.target.hostname, t.target.port) == ("nobody", "127.0.0.1",
                                                                      2222)
        assert t.connect_timeout == 3.0 and t.known_hosts.path == "/k/known_hosts"
        assert not t.known_hosts.accept_new
        assert t.connection is None  # nothing connected yet


def test_accepting_new_host_keys_comes_from_the_caller_or_the_data() -> None:
    with SshConn(name="w1", python="python3").open(accept_new_host_keys=True) as t:
        assert t.known_hosts.accept_new and t.connect_timeout == CONNECT_TIMEOUT
    with SshConn(name="w1", python="python3", accept_new_host_keys=True).open() as t:
        assert t.known_hosts.accept_new


def test_from_spec_reaches_the_host_by_name_when_no_address_is_given() -> None:
    conn = SshConn.from_spec(name="w1", host=None, user=None, port=None, key=None, jump=None,
                             python="python3")
    assert conn.host == "w1" and conn.machine_key() == ("ssh", None, "w1", None, None)
    assert conn.to_data() == {"transport": "ssh", "name": "w1", "host": "w1", "user": None,
                              "port": None, "key": None, "jump": None, "python": "python3"}
