"""A hostile client for the crowded-port tests: it holds idle TCP connections to a port from
several loopback addresses (127.0.0.2, 127.0.0.3, ...: Linux routes all of 127/8 to lo), and
opens a new one whenever the server ends one, until it is stopped."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time


class Crowd:
    """`per_address` idle connections to `target` from each of `addresses` source addresses,
    kept up by one thread per address; `first` bytes are sent on each (b"": none). `ended`
    counts the connections the server ended, `opened` those made."""

    def __init__(self, target: tuple[str, int], addresses: int, per_address: int,
                 first: bytes = b"") -> None:
        self.target, self.per_address, self.first = target, per_address, first
        self.sources = [f"127.0.0.{2 + i}" for i in range(addresses)]
        self.opened = self.ended = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._hold, args=(src,), daemon=True)
                         for src in self.sources]

    def __enter__(self) -> Crowd:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def wait_full(self, timeout: float = 10.0) -> None:
        """Until every address has opened its connections once."""
        deadline = time.monotonic() + timeout
        while self.opened < len(self.sources) * self.per_address:
            if time.monotonic() > deadline:
                raise AssertionError(f"the crowd opened only {self.opened} connections")
            time.sleep(0.02)

    def _hold(self, source: str) -> None:
        socks: list[socket.socket] = []
        try:
            while not self._stop.is_set():
                while len(socks) < self.per_address and not self._stop.is_set():
                    try:
                        sock = socket.create_connection(self.target, timeout=1,
                                                        source_address=(source, 0))
                        if self.first:
                            sock.sendall(self.first)
                    except OSError:
                        time.sleep(0.05)  # refused (a port not open yet, a full backlog)
                        continue
                    socks.append(sock)
                    with self._lock:
                        self.opened += 1
                readable, _, _ = select.select(socks, [], [], 0.05)
                for sock in readable:  # the server ended it (or sent something: drop it)
                    with contextlib.suppress(OSError):
                        sock.recv(65536)
                    sock.close()
                    socks.remove(sock)
                    with self._lock:
                        self.ended += 1
        finally:
            for sock in socks:
                sock.close()
