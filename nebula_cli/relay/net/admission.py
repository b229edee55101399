"""Connections that have not authenticated yet, on a port anyone may reach: who holds a slot,
for how long, and whose connection ends when a new one arrives.

Anyone can open TCP connections and send nothing: a port that keeps a fixed number of slots
for them, and refuses the newest when they are full, is closed to everybody by one client
holding idle connections. So an :class:`Admission`:

- never refuses the newest connection: when its address already holds ``per_address`` pending
  connections, the oldest of them is ended; when all ``total`` slots are held, the oldest
  connection of the address that holds the most is ended. A client can only crowd out its own
  connections, until it holds ``total / per_address`` addresses, and a real peer's handshake
  (milliseconds to a few round trips) is never the oldest for long;
- counts IPv6 addresses by their /64 (one host usually has a whole /64), IPv4 addresses (and
  IPv4-mapped IPv6 ones) one by one;
- ends every pending connection at its deadline (a clock in one thread per Admission, started
  on first use), whatever the connection trickles meanwhile; and the first bytes must arrive
  sooner (:func:`first_bytes`, FIRST_BYTES_TIMEOUT: a TLS client speaks first).

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


def address_key(ip: str) -> str:
    """What one client is counted as: an IPv4 address, or an IPv6 address's /64."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip  # "local" (a Unix socket) and the like
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


def first_bytes(sock: socket.socket, timeout: float = FIRST_BYTES_TIMEOUT) -> bool:
    """Whether `sock` has something to read (or its end) within `timeout` seconds."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(max(0.0, timeout) * 1000))


@dataclass(eq=False)
class Pending:
    """One admitted connection that has not authenticated yet."""

    key: str
    """Its address as counted (address_key)."""
    deadline: float
    handle: socket.socket | None
    """A duplicate of its descriptor, to end it from another thread; None once let go."""
    number: int = field(default_factory=itertools.count().__next__)
    ended: str | None = None
    """Why it was ended before it authenticated ("evicted", "deadline"), if it was."""


class Admission:
    """Pending connections of one listening port: at most `total`, `per_address` of them from
    one address (see the module's docstring); each ended `deadline` seconds after admission.
    ``admit`` returns the new connection's entry and the connections it ended; every entry is
    given back with ``release`` (authenticated, or failed)."""

    def __init__(self, total: int, per_address: int, deadline: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= per_address <= total:
            raise ValueError(f"per_address {per_address} must be within 1..total ({total})")
        self.total, self.per_address, self.deadline = total, per_address, deadline
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
        make room (already shut down)."""
        entry = Pending(address_key(ip), self._clock() + self.deadline, sock.dup())
        with self._changed:
            ended = []
            counts = self._counts()
            if counts.get(entry.key, 0) >= self.per_address:
                ended.append(self._oldest(entry.key))
            elif len(self._pending) >= self.total:
                most = max(counts.values())
                ended.append(next(p for p in self._pending.values() if counts[p.key] == most))
            for old in ended:
                self._end(old, "evicted")
            self._pending[entry.number] = entry
            self._ensure_clock()
            self._changed.notify_all()
        return entry, ended

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

    def _oldest(self, key: str) -> Pending:
        return next(p for p in self._pending.values() if p.key == key)

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
