"""Connections that have not authenticated yet, on a port anyone may reach: who holds a slot,
for how long, and whose connection ends when a new one arrives.

Anyone can open TCP connections and send nothing: a port that keeps a fixed number of slots
for them, and refuses the newest when they are full, is closed to everybody by one client
holding idle connections. So an :class:`Admission`:

- never ends a connection that has spoken (its first bytes, a TLS ClientHello, have arrived:
  the handler said so with ``spoke``, or they wait in the socket) to make room for a new one
  from its own network, or from a network holding almost as many: a real peer's handshake,
  under way, is never ended by a crowd of silent connections, nor by a crowd from a network
  holding more;
- otherwise never refuses the newest connection: when its address already holds
  ``per_address`` pending connections, the oldest silent one of them is ended; when all
  ``total`` slots are held, the oldest silent connection of the address holding the most, in
  the wider network holding the most (an IPv4 /24, an IPv6 /48), is ended, and when none is
  silent, the oldest connection of the network holding the most if it holds at least two more
  than the newcomer's (a crowd that sends first bytes and stalls still makes room for a client
  of another network). Only when none of those can be ended is the new connection itself
  refused (``Pending.ended`` is "refused");
- counts one client as an IPv4 address (IPv4-mapped IPv6 ones too) or an IPv6 address's /64
  (one host usually has a whole /64), and one network as an IPv4 /24, an IPv6 /48, or all of
  loopback (127.0.0.0/8 and ::1: every one of its addresses is free to any local user). A
  crowd on many addresses of one network ends its own connections first, never those of a
  client in a network holding fewer. Loopback's addresses keep a `per_address` cap each, not
  one for all: with one, a local peer's new connection would share `per_address` slots with
  a local crowd and be ended after `per_address - 1` of the crowd's, were its first bytes late;
- ends every pending connection at its deadline (a clock in one thread per Admission, started
  on first use), whatever the connection trickles meanwhile; and the first bytes must arrive
  sooner (:func:`first_bytes`, FIRST_BYTES_TIMEOUT: a TLS client speaks first).

- with a ``name`` (the peer port of a relay whose job has an admission name: its peers send it
  as their ClientHello's server name, SNI), a connection whose ClientHello names it is never
  ended for a new one, and one that spoke without it counts as silent: clients that share an
  address with the job's peers (other users of a host in a local job, on loopback, or of the
  host an SSH tunnel ends on; users behind the same NAT) cannot keep the peers out by
  speaking and stalling, as they could before their certificate is read.

What this does not hold: the name is sent in clear (TLS 1.3 encrypts no SNI), so whoever sees
the job's WAN traffic can send it too and is then counted as a peer is (their connections
still end at the deadline and cannot authenticate); without a name (the worker port, the
bench-network probe, a job planned before names) a client that speaks and stalls on every
slot of an address keeps new connections from that address out meanwhile.

Ending a connection is ``shutdown(SHUT_RDWR)`` on a duplicate of its descriptor taken at
admission: the thread handling it wakes from whatever read it blocks in, fails, and releases
the slot; the descriptor number is never reused under it.

Standard library only (the bench-network probe uses it too).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

FIRST_BYTES_TIMEOUT = 5.0
"""Seconds from accept to a pending connection's first byte (a TLS ClientHello, a first frame);
without one it is closed."""


LOOPBACK = "127.0.0.0/8"
"""The network every loopback address (127.0.0.0/8, ::1) is counted in: one."""


def _prefix(ip: str, v4: int, v6: int, loopback: bool) -> str:
    """The network of `ip` counted as one: an IPv4 /`v4`, an IPv6 /`v6` (IPv4-mapped IPv6
    addresses as IPv4), all of loopback when `loopback`."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip  # "local" (a Unix socket) and the like
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if loopback and addr.is_loopback:
        return LOOPBACK
    if isinstance(addr, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((addr, v6), strict=False))
    return str(addr) if v4 == 32 else str(ipaddress.IPv4Network((addr, v4), strict=False))


def address_key(ip: str) -> str:
    """What one client is counted as: an IPv4 address, or an IPv6 address's /64."""
    return _prefix(ip, 32, 64, loopback=False)


def network_key(ip: str) -> str:
    """The wider network a client is counted in when a full port ends someone's connection: an
    IPv4 /24, an IPv6 /48, all of loopback (every one of its addresses is free to any local
    user) as one."""
    return _prefix(ip, 24, 48, loopback=True)


def first_bytes(sock: socket.socket, timeout: float = FIRST_BYTES_TIMEOUT) -> bool:
    """Whether `sock` has something to read (or its end) within `timeout` seconds."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def _has_spoken(entry: Pending) -> bool:
    """Whether `entry`'s first bytes wait in its socket (its handler has not looked yet)."""
    if entry.handle is None:
        return False
    try:
        return first_bytes(entry.handle, 0)
    except (OSError, ValueError):
        return False


HELLO_PEEK_BYTES = 4096
"""What of a connection's first bytes is read for its ClientHello's server name."""


def _names(entry: Pending, name: str) -> bool:
    """Whether `entry`'s ClientHello has arrived and names `name` (peeked, not taken)."""
    if entry.handle is None:
        return False
    try:
        data = entry.handle.recv(HELLO_PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (OSError, ValueError):
        return False
    return client_hello_name(data) == name


@dataclass(eq=False)
class Pending:
    """One admitted connection that has not authenticated yet."""

    key: str
    """Its address as counted (address_key)."""
    network: str
    """Its wider network (network_key)."""
    deadline: float
    handle: socket.socket | None
    """A duplicate of its descriptor, to end it from another thread; None once let go."""
    number: int = field(default_factory=itertools.count().__next__)
    spoken: bool = False
    """Its first bytes arrived (``Admission.spoke``)."""
    named: bool = False
    """Its ClientHello named the Admission's ``name``: a peer of the job, never ended for a
    new connection."""
    ended: str | None = None
    """Why it was ended before it authenticated ("evicted", "deadline", "refused": a new one
    for which no silent connection could make room), if it was."""


class Admission:
    """Pending connections of one listening port: at most `total`, `per_address` of them from
    one address (see the module's docstring); each ended `deadline` seconds after admission.
    ``admit`` returns the new connection's entry and the connections it ended; ``spoke`` marks
    an entry whose first bytes arrived; every entry is given back with ``release``
    (authenticated, or failed)."""

    def __init__(self, total: int, per_address: int, deadline: float, *,
                 name: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= per_address <= total:
            raise ValueError(f"per_address {per_address} must be within 1..total ({total})")
        self.total, self.per_address, self.deadline = total, per_address, deadline
        self.name = name
        """The server name the job's peers send (None: none is known, nobody is told apart)."""
        self._clock = clock
        self._pending: dict[int, Pending] = {}  # in admission order: the first is the oldest
        self._changed = threading.Condition()
        self._clock_thread: threading.Thread | None = None
        self._closed = False

    @property
    def held(self) -> int:
        with self._changed:
            return len(self._pending)

    def counts(self) -> dict[str, int]:
        """Pending connections per address (as counted)."""
        with self._changed:
            return self._counts()

    def _counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for entry in self._pending.values():
            out[entry.key] = out.get(entry.key, 0) + 1
        return out

    def admit(self, sock: socket.socket, ip: str) -> tuple[Pending, list[Pending]]:
        """Admit `sock` (from `ip`): its entry, and the entries of the connections ended to
        make room (already shut down). When no silent connection could make room, the new one
        is refused instead: its entry is ended ("refused", `sock` shut down) and not held."""
        entry = Pending(address_key(ip), network_key(ip), self._clock() + self.deadline,
                        sock.dup())
        with self._changed:
            ended = []
            counts = self._counts()
            room = True
            if counts.get(entry.key, 0) >= self.per_address:
                room = self._make_room([p for p in self._pending.values() if p.key == entry.key],
                                       ended)
            elif len(self._pending) >= self.total:
                room = self._make_room(list(self._pending.values()), ended, entry)
            if not room:
                self._end(entry, "refused")
                return entry, ended
            self._pending[entry.number] = entry
            self._ensure_clock()
            self._changed.notify_all()
        return entry, ended

    def spoke(self, entry: Pending) -> None:
        """`entry`'s first bytes arrived: no new connection from its network (or one holding
        almost as many) ends it; with a ``name``, only one whose ClientHello names it is so
        kept (read without being taken from the socket), and it is never ended for a new one."""
        named = self.name is not None and _names(entry, self.name)
        with self._changed:
            entry.spoken = self.name is None or named
            entry.named = named

    def _make_room(self, among: list[Pending], ended: list[Pending],
                   newcomer: Pending | None = None) -> bool:
        """(Under the lock.) End the oldest silent connection of the address holding the most
        in the network holding the most, of `among`; with none silent and a `newcomer`, the
        oldest of the network holding the most if it holds at least two more than the
        newcomer's (a crowd that speaks and stalls still makes room for another network's
        client, never one of its own). Whether one was ended."""
        networks: dict[str, int] = {}
        addresses: dict[str, int] = {}
        for p in among:
            networks[p.network] = networks.get(p.network, 0) + 1
            addresses[p.key] = addresses.get(p.key, 0) + 1
        silent = [p for p in among if not p.spoken and not (
            _has_spoken(p) if self.name is None else self._named(p))]
        if not silent and newcomer is not None:
            ahead = networks.get(newcomer.network, 0) + 1
            silent = [p for p in among if networks[p.network] > ahead and not self._named(p)]
        if not silent:
            return False
        old = min(silent, key=lambda p: (-networks[p.network], -addresses[p.key], p.number))
        ended.append(old)
        self._end(old, "evicted")
        return True

    def _named(self, entry: Pending) -> bool:
        """Whether `entry`'s ClientHello named the Admission's ``name``: said by `spoke`, or
        peeked when its handler has not said it yet (both passes of `_make_room` keep it)."""
        return entry.named or (self.name is not None and _names(entry, self.name))

    def release(self, entry: Pending) -> None:
        """The connection authenticated, failed or was ended: its slot is free."""
        with self._changed:
            self._pending.pop(entry.number, None)
            self._let_go(entry)

    def close(self) -> None:
        """End every pending connection and the clock."""
        with self._changed:
            self._closed = True
            for entry in list(self._pending.values()):
                self._end(entry, "closed")
            self._changed.notify_all()

    def _end(self, entry: Pending, why: str) -> None:
        """(Under the lock.) Shut the connection down and free its slot."""
        self._pending.pop(entry.number, None)
        entry.ended = why
        if entry.handle is not None:
            with contextlib.suppress(OSError):
                entry.handle.shutdown(socket.SHUT_RDWR)
        self._let_go(entry)

    @staticmethod
    def _let_go(entry: Pending) -> None:
        if entry.handle is not None:
            entry.handle.close()
            entry.handle = None

    def _ensure_clock(self) -> None:
        if self._clock_thread is None:
            self._clock_thread = threading.Thread(target=self._expire, daemon=True,
                                                  name="admission-deadlines")
            self._clock_thread.start()

    def _expire(self) -> None:
        """End pending connections at their deadline."""
        with self._changed:
            while not self._closed:
                now = self._clock()
                for entry in [p for p in self._pending.values() if p.deadline <= now]:
                    self._end(entry, "deadline")
                nearest = min((p.deadline for p in self._pending.values()), default=None)
                self._changed.wait(None if nearest is None else max(0.0, nearest - now) + 0.01)


def client_hello_name(data: bytes) -> str | None:
    """The server name (SNI, RFC 6066) of the TLS ClientHello that `data` begins with, if it
    holds one whole and names a host; None for anything else (not TLS, cut short, no name)."""
    try:
        if data[0] != 0x16 or data[5] != 0x01:  # a handshake record holding a ClientHello
            return None
        end = min(len(data), 5 + int.from_bytes(data[3:5], "big"))
        at = 5 + 4 + 2 + 32  # the handshake's header, client_version, random
        at += 1 + data[at]  # session_id
        at += 2 + int.from_bytes(data[at:at + 2], "big")  # cipher_suites
        at += 1 + data[at]  # compression_methods
        stop = min(end, at + 2 + int.from_bytes(data[at:at + 2], "big"))
        at += 2
        while at + 4 <= stop:
            kind, size = int.from_bytes(data[at:at + 2], "big"), int.from_bytes(
                data[at + 2:at + 4], "big")
            at += 4
            if kind == 0 and at + size <= stop:  # server_name: a list of (type, name)
                body = data[at:at + size]
                if len(body) >= 5 and body[2] == 0:
                    n = int.from_bytes(body[3:5], "big")
                    if 5 + n <= len(body):
                        return body[5:5 + n].decode("ascii")
                return None
            at += size
    except (IndexError, UnicodeDecodeError):
        return None
    return None
