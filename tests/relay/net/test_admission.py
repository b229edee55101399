"""nebula_cli.relay.net.admission on real loopback sockets: how clients are counted (an IPv6
/64 as one), that the newest connection is never refused (its address's oldest, or the oldest
of the address holding the most, is ended: the client sees the end at once), and that a
pending connection is ended at its deadline whatever it trickles."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from nebula_cli.relay.net.admission import Admission, address_key, first_bytes


@pytest.mark.parametrize(("ip", "key"), [
    ("198.18.0.7", "198.18.0.7"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff:1:2:3", "2001:db8:1:2::/64"),  # the same /64: one client
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("fe80::1%eth0", "fe80::/64"),
    ("::ffff:198.18.0.7", "198.18.0.7"),  # IPv4 on a dual-stack socket
    ("local", "local"),
])
def test_clients_are_counted_by_address_and_ipv6_by_its_64(ip: str, key: str) -> None:
    assert address_key(ip) == key


@pytest.fixture
def port() -> Iterator[socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    yield listener
    listener.close()


class Pairs:
    """Client and server ends of loopback connections from a chosen source address."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.made: list[tuple[socket.socket, socket.socket]] = []

    def connect(self, source: str) -> tuple[socket.socket, socket.socket]:
        client = socket.create_connection(self.listener.getsockname(), timeout=2,
                                          source_address=(source, 0))
        server, _ = self.listener.accept()
        self.made.append((client, server))
        return client, server

    def close(self) -> None:
        for client, server in self.made:
            client.close()
            server.close()


def ended(client: socket.socket, within: float = 2.0) -> bool:
    """Whether the server side shut the connection down (the client reads its end)."""
    client.settimeout(within)
    try:
        return client.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_the_newest_is_admitted_and_an_addresss_oldest_ends(port: socket.socket) -> None:
    pairs, gate = Pairs(port), Admission(total=6, per_address=2, deadline=60)
    try:
        a1, a2, a3 = (pairs.connect("127.0.0.2") for _ in range(3))
        e1, _ = gate.admit(a1[1], "127.0.0.2")
        gate.admit(a2[1], "127.0.0.2")
        e3, gone = gate.admit(a3[1], "127.0.0.2")  # a third from the same address
        assert gone == [e1] and e1.ended == "evicted" and gate.held == 2
        assert ended(a1[0]) and not ended(a2[0], 0.2) and not ended(a3[0], 0.2)
        gate.release(e1)  # the handler of the ended one gives its entry back: no effect
        assert gate.counts() == {"127.0.0.2": 2}
        gate.release(e3)
        assert gate.counts() == {"127.0.0.2": 1}
    finally:
        gate.close()
        pairs.close()


def test_a_full_port_ends_the_oldest_of_the_address_holding_the_most(
        port: socket.socket) -> None:
    pairs, gate = Pairs(port), Admission(total=4, per_address=3, deadline=60)
    try:
        real = pairs.connect("127.0.0.1")
        gate.admit(real[1], "127.0.0.1")  # the oldest of all, alone at its address
        crowd = [pairs.connect("127.0.0.2") for _ in range(3)]
        entries = [gate.admit(server, "127.0.0.2")[0] for _, server in crowd]
        newcomer = pairs.connect("127.0.0.3")
        _, gone = gate.admit(newcomer[1], "127.0.0.3")
        assert gone == [entries[0]] and ended(crowd[0][0])
        assert not ended(real[0], 0.2)  # the real peer, older, keeps its slot
        assert gate.counts() == {"127.0.0.1": 1, "127.0.0.2": 2, "127.0.0.3": 1}
    finally:
        gate.close()
        pairs.close()


def test_a_pending_connection_ends_at_its_deadline_whatever_it_trickles(
        port: socket.socket) -> None:
    pairs, gate = Pairs(port), Admission(total=4, per_address=4, deadline=0.6)
    try:
        client, server = pairs.connect("127.0.0.2")
        assert not first_bytes(server, 0.1)  # nothing sent yet
        gate.admit(server, "127.0.0.2")
        t0 = time.monotonic()
        client.settimeout(0.1)
        while time.monotonic() - t0 < 3:
            try:
                client.send(b"\x16")  # a byte now and then: never idle long
            except OSError:
                break
            try:
                if client.recv(1) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break
        assert 0.5 < time.monotonic() - t0 < 2.0 and gate.held == 0
        assert first_bytes(server, 0.1)  # what it trickled (and then its end) is there
    finally:
        gate.close()
        pairs.close()
