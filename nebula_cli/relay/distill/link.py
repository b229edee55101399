"""`LabelLink`: one authenticated connection of the soft-label service (a student's or a
server's to a label relay): frames read by one thread, written by any under one lock, the
time of the last frame heard (a watchdog ends a link silent for ``dead_after``), and an end
that wakes its reader at once."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable

from nebula_cli.relay.net.duplex import DuplexTLS
from nebula_cli.relay.net.wire import Frame, FrameType, WireError, recv_frame, send_frame


class LabelLink:
    """A TLS connection after its HELLO: ``send`` from any thread, ``recv`` from one."""

    def __init__(self, sock: ssl.SSLSocket, peer: str, max_payload: int) -> None:
        self.sock, self.peer, self.max_payload = sock, peer, max_payload
        self.io = DuplexTLS(sock)
        self.heard = time.monotonic()
        self.closed = threading.Event()
        self._send = threading.Lock()

    def send(self, frame: Frame) -> bool:
        """Send one frame; False (and the link ended) when it cannot be."""
        if self.closed.is_set():
            return False
        try:
            with self._send:
                send_frame(self.io, frame)  # type: ignore[arg-type]  # sendall, as a socket's
            return True
        except (WireError, OSError):
            self.close()
            return False

    def recv(self) -> Frame:
        """The next frame other than a heartbeat (WireError when the link ends)."""
        while True:
            frame = recv_frame(self.io, max_payload=self.max_payload)  # type: ignore[arg-type]
            self.heard = time.monotonic()
            if frame.type is not FrameType.HEARTBEAT:
                return frame

    def silent_for(self) -> float:
        return time.monotonic() - self.heard

    def close(self) -> None:
        """End the link (its reader wakes with an error); idempotent."""
        if self.closed.is_set():
            return
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


def keep_alive(links: Callable[[], list[LabelLink]], every: float, dead_after: float,
               stop: threading.Event) -> None:
    """Every ``every`` seconds: a heartbeat on each link, and the end of each link silent for
    ``dead_after`` seconds (its reader then fails over). Runs until ``stop``."""
    while not stop.wait(every):
        for link in links():
            if link.silent_for() > dead_after:
                link.close()
            else:
                link.send(Frame(FrameType.HEARTBEAT))
