"""A TCP proxy on 127.0.0.1 that holds every chunk it forwards for `delay` seconds each way: a
WAN's round trip for a handshake, between two processes on one machine. As over a WAN, the
far end sees the connection when its first bytes arrive (a client's ClientHello follows its
TCP handshake at once): the proxy connects there once the first chunk has waited its delay."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class SlowLink:
    """Listens on 127.0.0.1 (`port`); each connection is forwarded to `target` with every chunk
    held `delay` seconds first, both ways. `close` ends it and every connection."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self.target, self.delay = target, delay
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                near, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._socks.append(near)
            threading.Thread(target=self._open, args=(near,), daemon=True).start()

    def _open(self, near: socket.socket) -> None:
        """The far connection, opened with the first chunk; then both ways pumped."""
        with contextlib.suppress(OSError):
            first = near.recv(65536)
            if not first:
                near.close()
                return
            time.sleep(self.delay)
            far = socket.create_connection(self.target, timeout=5)
            far.settimeout(None)
            self._socks.append(far)
            far.sendall(first)
            threading.Thread(target=self._pump, args=(far, near), daemon=True).start()
            self._pump(near, far)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                time.sleep(self.delay)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self.server.close()
        self._thread.join(5)
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
