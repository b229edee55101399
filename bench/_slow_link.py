"""`SlowLink`: a TCP proxy on loopback that holds every byte for a one-way delay and paces it
to a rate, each way: the distillation bench's stand-in for a WAN link between two sites."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class SlowLink:
    """Listens on 127.0.0.1 (``port``); each connection goes to ``target`` with ``delay_ms``
    one way and at most ``rate_mbit`` per direction (None: no pacing; on the test bed the
    link's tbf paces)."""

    def __init__(self, target: tuple[str, int], delay_ms: float,
                 rate_mbit: float | None) -> None:
        self.target, self.delay = target, delay_ms / 1000
        self.rate = rate_mbit * 1e6 / 8 if rate_mbit else float("inf")
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self._server.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target)
            except OSError:  # the far end is gone (a stopped replica): so is this connection
                a.close()
                continue
            self._socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        free_at = 0.0  # when the link is free to send the next byte
        try:
            while data := src.recv(65536):
                now = time.monotonic()
                free_at = max(free_at, now) + len(data) / self.rate
                arrive = free_at + self.delay
                time.sleep(max(0.0, arrive - time.monotonic()))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._server.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
