"""`SlowLink`: a TCP proxy on loopback that holds every byte for a one-way delay and paces it
to a rate, each way: the distillation bench's stand-in for a WAN link between two sites."""

from __future__ import annotations

import collections
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
        """One direction: a delay line. What is read is queued with the time it arrives at
        the far end (after the bytes ahead of it are paced out, plus the delay) and a writer
        sends it then, so that bytes sent one after the other each take the delay once (a
        reader that slept out each chunk's delay before reading the next would add them
        up)."""
        line: collections.deque[tuple[float, bytes | None]] = collections.deque()
        ready = threading.Condition()
        threading.Thread(target=self._deliver, args=(line, ready, src, dst), daemon=True).start()
        free_at = 0.0  # when the link is free to send the next byte
        try:
            while data := src.recv(65536):
                now = time.monotonic()
                free_at = max(free_at, now) + len(data) / self.rate
                with ready:
                    line.append((free_at + self.delay, data))
                    ready.notify()
        except OSError:
            pass
        with ready:
            line.append((time.monotonic() + self.delay, None))  # the end, delayed as well
            ready.notify()

    @staticmethod
    def _deliver(line: collections.deque[tuple[float, bytes | None]],
                 ready: threading.Condition, src: socket.socket, dst: socket.socket) -> None:
        """Sends what the reader queued when it is due; if the far end is gone, the reader is
        stopped too (nothing would drain its queue)."""
        try:
            while True:
                with ready:
                    while not line:
                        ready.wait()
                    arrive, data = line.popleft()
                time.sleep(max(0.0, arrive - time.monotonic()))
                if data is None:
                    break
                dst.sendall(data)
        except OSError:
            with contextlib.suppress(OSError):
                src.shutdown(socket.SHUT_RDWR)
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._server.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
