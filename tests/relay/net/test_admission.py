"""nebula_cli.relay.net.admission on real loopback sockets: how clients are counted (an IPv6
/64 as one), that the newest connection is never refused (its address's oldest, or the oldest
of the address holding the most, is ended: the client sees the end at once), and that a
pending connection is ended at its deadline whatever it trickles."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from helpers.tls_handshake import client_hello

from nebula_cli.relay.net.admission import (
    Admission,
    address_key,
    client_hello_name,
    first_bytes,
    network_key,
)


@pytest.mark.parametrize(("ip", "key"), [
    ("198.18.0.7", "198.18.0.7"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff:1:2:3", "2001:db8:1:2::/64"),  # the same /64: one client
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("fe80::1%eth0", "fe80::/64"),
    ("::ffff:198.18.0.7", "198.18.0.7"),  # IPv4 on a dual-stack socket
    ("local", "local"),
    ("127.45.6.7", "127.45.6.7"),  # one address (its network is all of loopback)
])
def test_clients_are_counted_by_address_and_ipv6_by_its_64(ip: str, key: str) -> None:
    assert address_key(ip) == key


@pytest.mark.parametrize(("ip", "network"), [
    ("198.18.0.7", "198.18.0.0/24"),
    ("198.18.0.250", "198.18.0.0/24"),
    ("198.18.1.7", "198.18.1.0/24"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1::/48"),
    ("2001:db8:1:ffff::1", "2001:db8:1::/48"),
    ("::ffff:198.18.0.7", "198.18.0.0/24"),
    ("127.3.2.1", "127.0.0.0/8"),  # every loopback address is free to a local user: one
    ("::ffff:127.0.0.9", "127.0.0.0/8"),
    ("::1", "127.0.0.0/8"),
    ("local", "local"),
])
def test_wider_networks_are_ipv4_24s_ipv6_48s_and_all_of_loopback(ip: str, network: str) -> None:
    assert network_key(ip) == network


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
        e1, _ = gate.admit(a1[1], "198.18.0.2")
        gate.admit(a2[1], "198.18.0.2")
        e3, gone = gate.admit(a3[1], "198.18.0.2")  # a third from the same address
        assert gone == [e1] and e1.ended == "evicted" and gate.held == 2
        assert ended(a1[0]) and not ended(a2[0], 0.2) and not ended(a3[0], 0.2)
        gate.release(e1)  # the handler of the ended one gives its entry back: no effect
        assert gate.counts() == {"198.18.0.2": 2}
        gate.release(e3)
        assert gate.counts() == {"198.18.0.2": 1}
    finally:
        gate.close()
        pairs.close()


def test_a_full_port_ends_the_oldest_of_the_address_holding_the_most(
        port: socket.socket) -> None:
    pairs, gate = Pairs(port), Admission(total=4, per_address=3, deadline=60)
    try:
        real = pairs.connect("127.0.0.1")
        gate.admit(real[1], "198.18.0.1")  # the oldest of all, alone at its address
        crowd = [pairs.connect("127.0.0.2") for _ in range(3)]
        entries = [gate.admit(server, "198.18.0.2")[0] for _, server in crowd]
        newcomer = pairs.connect("127.0.0.3")
        _, gone = gate.admit(newcomer[1], "198.18.0.3")
        assert gone == [entries[0]] and ended(crowd[0][0])
        assert not ended(real[0], 0.2)  # the real peer, older, keeps its slot
        assert gate.counts() == {"198.18.0.1": 1, "198.18.0.2": 2, "198.18.0.3": 1}
    finally:
        gate.close()
        pairs.close()


def test_a_pending_connection_ends_at_its_deadline_whatever_it_trickles(
        port: socket.socket) -> None:
    pairs, gate = Pairs(port), Admission(total=4, per_address=4, deadline=0.6)
    try:
        client, server = pairs.connect("127.0.0.2")
        assert not first_bytes(server, 0.1)  # nothing sent yet
        gate.admit(server, "198.18.0.2")
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


def test_a_crowd_of_loopback_addresses_never_ends_a_handshake_that_has_spoken(
        port: socket.socket) -> None:
    """The review's case: 40 source addresses of 127/8 (free to any local user) each holding a
    silent connection evicted every real handshake. A connection whose ClientHello arrived is
    never ended for a silent one."""
    pairs, gate = Pairs(port), Admission(total=32, per_address=4, deadline=60)
    try:
        real_client, real_server = pairs.connect("127.0.0.1")
        real, _ = gate.admit(real_server, "127.0.0.1")
        real_client.sendall(b"\x16\x03\x01")  # a ClientHello's first bytes
        assert first_bytes(real_server, 2)
        crowd = [pairs.connect(f"127.0.{1 + i // 200}.{2 + i % 200}") for i in range(40)]
        gone = [old for _, server in crowd
                for old in gate.admit(server, server.getpeername()[0])[1]]
        assert real not in gone and real.ended is None and not ended(real_client, 0.2)
        assert len(gone) == 9 and gate.held == 32  # the crowd ended its own connections
        gate.spoke(real)  # the handler read it (nothing waits in the socket any more)
        real_server.recv(3)
        more = [pairs.connect("127.9.9.9") for _ in range(8)]
        gone = [old for _, server in more for old in gate.admit(server, "127.9.9.9")[1]]
        assert real not in gone and not ended(real_client, 0.2)
    finally:
        gate.close()
        pairs.close()


def test_when_every_room_making_connection_has_spoken_the_new_one_is_refused(
        port: socket.socket) -> None:
    pairs, gate = Pairs(port), Admission(total=4, per_address=2, deadline=60)
    try:
        held = [pairs.connect("127.0.0.2") for _ in range(2)]
        entries = [gate.admit(server, "198.18.0.2")[0] for _, server in held]
        for entry in entries:
            gate.spoke(entry)
        client, server = pairs.connect("127.0.0.2")
        newest, gone = gate.admit(server, "198.18.0.2")
        assert gone == [] and newest.ended == "refused" and ended(client)
        assert gate.counts() == {"198.18.0.2": 2}
        assert not any(ended(c, 0.1) for c, _ in held)
    finally:
        gate.close()
        pairs.close()


def test_a_full_port_ends_a_connection_of_the_network_holding_the_most(
        port: socket.socket) -> None:
    """Addresses of one /24 are one crowd: a full port ends one of theirs, not the older
    connection of a client alone in its network, even when every address holds one."""
    pairs, gate = Pairs(port), Admission(total=6, per_address=3, deadline=60)
    try:
        real = pairs.connect("127.0.0.2")
        mine, _ = gate.admit(real[1], "198.18.1.1")  # the oldest, alone in 198.18.1.0/24
        crowd = [pairs.connect("127.0.0.2") for _ in range(5)]
        entries = [gate.admit(server, f"198.18.0.{1 + i}")[0]
                   for i, (_, server) in enumerate(crowd)]
        newcomer = pairs.connect("127.0.0.2")
        _, gone = gate.admit(newcomer[1], "2001:db8:1:2::1")
        assert gone == [entries[0]] and ended(crowd[0][0])
        assert mine.ended is None and not ended(real[0], 0.2)
    finally:
        gate.close()
        pairs.close()


def test_a_crowd_that_speaks_and_stalls_still_makes_room_for_another_networks_client(
        port: socket.socket) -> None:
    """Every slot held by connections that sent first bytes and stall (from one /24): a client
    of another network still gets in (the crowd's oldest is ended), one of the crowd's own
    network does not (it would only crowd itself), nor does one when the networks hold alike."""
    pairs, gate = Pairs(port), Admission(total=4, per_address=4, deadline=60)
    try:
        crowd = [pairs.connect("127.0.0.2") for _ in range(4)]
        entries = [gate.admit(server, f"198.18.0.{1 + i}")[0]
                   for i, (_, server) in enumerate(crowd)]
        for entry in entries:
            gate.spoke(entry)
        own = pairs.connect("127.0.0.2")
        refused, gone = gate.admit(own[1], "198.18.0.9")
        assert gone == [] and refused.ended == "refused" and ended(own[0])
        other = pairs.connect("127.0.0.3")
        admitted, gone = gate.admit(other[1], "203.0.113.5")
        assert gone == [entries[0]] and admitted.ended is None and ended(crowd[0][0])
        gate.spoke(admitted)
        assert gate.counts() == {"198.18.0.2": 1, "198.18.0.3": 1, "198.18.0.4": 1,
                                 "203.0.113.5": 1}
        third, gone = gate.admit(pairs.connect("127.0.0.4")[1], "192.0.2.7")  # /24s: 3 and 1
        assert gone == [entries[1]]
        gate.spoke(third)
        fourth, gone = gate.admit(pairs.connect("127.0.0.5")[1], "192.0.3.7")  # 2 of 198.18.0
        assert gone == [entries[2]]
        gate.spoke(fourth)
        # four networks holding one each, all spoken: a fifth network's client is refused
        late, gone = gate.admit(pairs.connect("127.0.0.6")[1], "192.0.4.7")
        assert gone == [] and late.ended == "refused"
        assert sorted(gate.counts()) == ["192.0.2.7", "192.0.3.7", "198.18.0.4", "203.0.113.5"]
    finally:
        gate.close()
        pairs.close()


def test_the_server_name_is_read_from_a_real_client_hello_and_nothing_else() -> None:
    name = "0123456789abcdef0123456789abcdef.nebula"
    hello = client_hello(name)
    assert client_hello_name(hello) == name
    assert client_hello_name(client_hello(None)) is None
    assert client_hello_name(client_hello("other.example")) == "other.example"
    for junk in (b"", b"\x16\x03\x01", b"GET / HTTP/1.1\r\n", hello[:60], bytes(600)):
        assert client_hello_name(junk) is None, junk[:20]


def test_with_a_name_only_a_connection_that_names_it_is_kept_for_having_spoken(
        port: socket.socket) -> None:
    """A crowd that shares the job's peers' address (loopback, a NAT) speaks and stalls on
    every slot: without a name the peer's new connection is refused (every slot spoke, all in
    its network); with one, the crowd's spoken connections count as silent, the peer gets in,
    and once its ClientHello named the name no new connection ends it."""
    name = "0123456789abcdef0123456789abcdef.nebula"
    for gate_name, peer_gets_in in ((None, False), (name, True)):
        pairs, gate = Pairs(port), Admission(total=4, per_address=2, deadline=60, name=gate_name)
        try:
            crowd = [pairs.connect("127.0.0.2") for _ in range(4)]
            entries = []
            for i, (client, server) in enumerate(crowd):
                entries.append(gate.admit(server, f"127.0.0.{2 + i // 2}")[0])
                client.sendall(client_hello("crowd.example"))
                assert first_bytes(server, 2)
                gate.spoke(entries[-1])
            peer_client, peer_server = pairs.connect("127.0.0.1")
            peer, gone = gate.admit(peer_server, "127.0.0.1")
            assert (peer.ended is None) == peer_gets_in, gate_name
            if not peer_gets_in:
                assert gone == [] and peer.ended == "refused"
                continue
            assert gone == [entries[0]] and ended(crowd[0][0])
            peer_client.sendall(client_hello(name))
            assert first_bytes(peer_server, 2)
            gate.spoke(peer)
            assert peer.named
            more = [pairs.connect("127.0.0.2") for _ in range(6)]
            gone = [old for i, (_, server) in enumerate(more)
                    for old in gate.admit(server, f"127.0.0.{5 + i}")[1]]
            assert peer not in gone and peer.ended is None and not ended(peer_client, 0.2)
        finally:
            gate.close()
            pairs.close()


def test_a_peer_whose_client_hello_named_the_job_is_kept_before_its_handler_says_so(
        port: socket.socket) -> None:
    """Every slot held by the job's peers (loopback: one network), the newest of them with its
    ClientHello arrived but not yet said by its handler (`spoke`): a client of another network
    ends none of them, it is refused."""
    name = "0123456789abcdef0123456789abcdef.nebula"
    pairs, gate = Pairs(port), Admission(total=4, per_address=4, deadline=60, name=name)
    try:
        peers = [pairs.connect("127.0.0.1") for _ in range(4)]
        entries = []
        for client, server in peers:
            entries.append(gate.admit(server, "127.0.0.1")[0])
            client.sendall(client_hello(name))
            assert first_bytes(server, 2)
        for entry in entries[:3]:
            gate.spoke(entry)
        assert [e.named for e in entries] == [True, True, True, False]
        late, gone = gate.admit(pairs.connect("127.0.0.3")[1], "203.0.113.5")
        assert gone == [] and late.ended == "refused"
        assert all(e.ended is None for e in entries) and not ended(peers[3][0], 0.2)
    finally:
        gate.close()
        pairs.close()
