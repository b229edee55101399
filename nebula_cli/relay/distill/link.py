"""`LabelLink`: one authenticated connection of the soft-label service (a student's or a
server's to a label relay): frames read by one thread and written by the link's own sender
thread from a bounded queue (``send`` never waits on the peer: a frame beyond the queue's
bound ends the link), the time of the last frame heard and how long the frame being written
has been at it (a watchdog ends a link silent for ``dead_after``, or whose peer has not read
one frame in that time), and an end that wakes its reader and its sender at once."""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

from nebula_cli.relay.net.duplex import DuplexTLS
from nebula_cli.relay.net.wire import (
    HEADER_SIZE,
    LINGER_S,
    Frame,
    FrameType,
    WireError,
    close_after_refusal,
    recv_frame,
    send_frame,
)

log = logging.getLogger("nebula.relay.distill")

FRAME_BYTES = HEADER_SIZE + 1024
"""What a frame counts in a sender's queue beside its payload (its header, and a meta as this
service's messages make them)."""

END_S = 5.0
"""Seconds a link's last frame (a refusal) may take before the link ends without it."""


def queued_bytes(frame: Frame) -> int:
    """What ``frame`` counts in a sender's queue: its payload and ``FRAME_BYTES``."""
    return memoryview(frame.payload).nbytes + FRAME_BYTES


def queue_bound(frames: int, max_payload: int) -> int:
    """A sender's bound in bytes for ``frames`` frames of at most ``max_payload`` each (and
    the heartbeats between them)."""
    return frames * (max_payload + FRAME_BYTES) + 16 * FRAME_BYTES


class LabelLink:
    """A TLS connection after its HELLO: ``send`` from any thread (queued, at most
    ``queue_bytes`` waiting), ``recv`` from one."""

    def __init__(self, sock: ssl.SSLSocket, peer: str, max_payload: int, *,
                 queue_bytes: int) -> None:
        self.sock, self.peer, self.max_payload = sock, peer, max_payload
        self.queue_bytes = queue_bytes
        self.io = DuplexTLS(sock)
        self.heard = time.monotonic()
        self.closed = threading.Event()
        self.why: str | None = None
        """Why the link was ended by this side (None: its peer or an error ended it)."""
        self._cond = threading.Condition()
        self._queue: collections.deque[Frame | None] = collections.deque()
        self._queued = 0
        self._writing_since: float | None = None
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"labels-send-{peer}")
        self._sender.start()

    def send(self, frame: Frame) -> bool:
        """Queue one frame; False (and the link ended) when it cannot be: the link is closed,
        or the frames waiting for its peer to read would pass ``queue_bytes``."""
        if self.closed.is_set():
            return False
        size = queued_bytes(frame)
        with self._cond:
            over = self._queued + size > self.queue_bytes
            if not over:
                self._queue.append(frame)
                self._queued += size
                self._cond.notify_all()
        if over:
            self.close(f"{self.peer} does not read: {self._queued} bytes wait for it")
            return False
        return True

    def end(self, frame: Frame, timeout: float = END_S) -> None:
        """Send ``frame`` (a refusal) last, then end the link: after it is sent (this side's
        FIN, what the peer still sends read and dropped, then closed: no reset that would fail
        the peer's next send before it reads why, `close_after_refusal`), or after ``timeout``
        seconds when it cannot be. Called by the link's reader (nothing else reads it)."""
        with self._cond:
            self._queue.extend((frame, None))
            self._cond.notify_all()
        self._sender.join(timeout)
        self.close()

    def recv(self) -> Frame:
        """The next frame other than a heartbeat (WireError when the link ends)."""
        while True:
            frame = recv_frame(self.io, max_payload=self.max_payload)  # type: ignore[arg-type]
            self.heard = time.monotonic()
            if frame.type is not FrameType.HEARTBEAT:
                return frame

    def silent_for(self) -> float:
        return time.monotonic() - self.heard

    def stuck_for(self) -> float:
        """Seconds the frame being written has waited for its peer to read (0: none)."""
        since = self._writing_since
        return 0.0 if since is None else time.monotonic() - since

    def close(self, why: str | None = None) -> None:
        """End the link (its reader and its sender wake with an error); idempotent."""
        if not self._mark_closed():
            return
        self.why = why
        if why is not None:
            log.warning("soft labels: ended the link of %s: %s", self.peer, why)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def _mark_closed(self) -> bool:
        """Mark the link ended and wake its sender; False when it already was."""
        with self._cond:
            if self.closed.is_set():
                return False
            self.closed.set()
            self._cond.notify_all()
        return True

    def _close_after_refusal(self) -> None:
        if self._mark_closed():
            close_after_refusal(self.sock, seconds=min(LINGER_S, END_S / 2))

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self.closed.is_set())
                if self.closed.is_set():
                    return
                frame = self._queue.popleft()
                self._writing_since = time.monotonic()
            if frame is None:  # end()'s: the refusal before it is sent
                self._close_after_refusal()
                return
            try:
                send_frame(self.io, frame)  # type: ignore[arg-type]  # sendall, as a socket's
            except (WireError, OSError):
                self.close()
                return
            with self._cond:
                self._writing_since = None
                self._queued -= queued_bytes(frame)


def keep_alive(links: Callable[[], list[LabelLink]], every: float, dead_after: float,
               stop: threading.Event) -> None:
    """Every ``every`` seconds: a heartbeat on each link, and the end of each link silent for
    ``dead_after`` seconds or whose peer has not read a frame in that time (its reader then
    fails over). Runs until ``stop``; never waits on a link's peer."""
    while not stop.wait(every):
        for link in links():
            if link.silent_for() > dead_after:
                link.close(f"silent for {link.silent_for():.1f} s")
            elif link.stuck_for() > dead_after:
                link.close(f"read nothing for {link.stuck_for():.1f} s")
            else:
                link.send(Frame(FrameType.HEARTBEAT))
