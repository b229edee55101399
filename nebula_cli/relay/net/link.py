"""One live peer link: a mutually authenticated connection to another cluster's relay, with a
sender thread and a receiver thread, frame I/O and liveness.

The connection is AES-GCM records keyed inside the link's TLS handshake
(:class:`~nebula_cli.relay.net.gcm_records.RecordConn`: each thread has its own direction), or TLS
itself when the peer did not offer records; then both threads use the socket through
:class:`DuplexTLS`, which serialises their OpenSSL calls (two threads may not be inside
SSL_read and SSL_write at once) and waits outside its lock.
Control frames jump ahead of bulk ones; WAN shaping is applied on the sender; an idle link
carries heartbeats (the relay's :class:`~nebula_cli.relay.net.messages.RelayProgress`);
:attr:`PeerLink.last_rx` tells the relay's ticker whether it is alive. What a frame means is
not this module's business: received frames go to ``on_frame``.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from nebula_cli.config.relay_config import ShapingConfig
from nebula_cli.errors import NebulaError
from nebula_cli.relay.codecs.base import CodecError
from nebula_cli.relay.net.buffers import BufferPool
from nebula_cli.relay.net.duplex import DuplexTLS
from nebula_cli.relay.net.framing import send_frames
from nebula_cli.relay.net.gcm_records import RecordConn
from nebula_cli.relay.net.messages import Goodbye, Refusal, RelayProgress
from nebula_cli.relay.net.schema import encode
from nebula_cli.relay.net.shaping import Shaper
from nebula_cli.relay.net.wire import (
    HEADER_SIZE,
    ConnectionClosed,
    Frame,
    FrameType,
    WireError,
    close_after_refusal,
    encode_frame,
    encode_meta,
    recv_frame,
)

LinkConn = ssl.SSLSocket | RecordConn
"""What a link runs on: AES-GCM records after the TLS handshake, or TLS."""


class LinkDown(NebulaError):
    """The link to a peer is not connected (or just went away)."""


class _Watched:
    """The receive side of a link's socket, noting the time of every byte that arrives (so a
    large frame on a slow link still counts as traffic)."""

    def __init__(self, link: PeerLink) -> None:
        self.link = link

    def recv_into(self, buf: Any, nbytes: int = 0) -> int:
        n = self.link.io.recv_into(buf, nbytes)
        self.link.last_rx = time.monotonic()
        return n


class PeerLink:
    """One live TLS connection to a peer relay. ``start()``, ``send()``, ``close(reason)``.

    ``on_frame(link, frame)`` runs on the receiver thread for every frame but BYE and ERROR;
    an exception it raises (a protocol error) closes the link. ``on_close(link, reason)`` runs
    once when the link closes. ``progress`` is the peer's as its hello said; ``beat()`` gives
    this relay's progress for a heartbeat; ``payload_cap()`` the largest payload accepted in the
    next frame (checked before it is allocated).
    """

    def __init__(self, cluster: str, conn: LinkConn, progress: RelayProgress, *,
                 shaping: ShapingConfig, heartbeat: float,
                 on_frame: Callable[[PeerLink, Frame], None],
                 on_close: Callable[[PeerLink, str], None],
                 beat: Callable[[], RelayProgress], payload_cap: Callable[[], int]) -> None:
        self.cluster = cluster
        self.io: RecordConn | DuplexTLS
        if isinstance(conn, RecordConn):
            self.sock: socket.socket = conn.sock
            self.io = conn
            conn.on_recv = self._touch  # a large record on a slow link still shows traffic
        else:
            self.sock, self.io = conn, DuplexTLS(conn)
        self.records = isinstance(conn, RecordConn)
        """The link runs on AES-GCM records (False: on TLS)."""
        self.buffers = BufferPool()
        """Where received payloads land: a round's chunks in the last rounds' memory."""
        self.last_rx = time.monotonic()
        self.addr = peer_addr(self.sock)
        self.shaper = Shaper.from_config(shaping)
        self.heartbeat = heartbeat
        self.done = -1
        self.state_round: int | None = None
        self.result_round: int | None = None
        self.finished: int | None = None
        self.lineage: str | None = None
        self.progress(progress)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.connected_at = time.time()
        self.closed = False
        self.reason = ""
        self.left_job = False
        """The peer said goodbye as its cluster left the job for good (`Goodbye.leaving`)."""
        self._on_frame, self._on_close = on_frame, on_close
        self._beat, self._payload_cap = beat, payload_cap
        self._control: deque[tuple[Frame, float]] = deque()
        self._data: deque[tuple[Frame, float]] = deque()
        self._cv = threading.Condition()
        self._bulk_pending = 0  # bulk frames queued or being written
        self._last_tx = time.monotonic()
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"relay-send-{cluster}", daemon=True),
            threading.Thread(target=self._recv_loop, name=f"relay-recv-{cluster}", daemon=True),
        ]

    def _touch(self) -> None:
        self.last_rx = time.monotonic()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def progress(self, p: RelayProgress) -> None:
        """A peer's progress (HELLO or heartbeat): its newest round, state and result, its
        lineage, and the round its workers finished at (None while they train)."""
        self.done, self.state_round, self.result_round = p.done, p.state_round, p.result_round
        self.finished, self.lineage = p.finished, p.lineage

    def send(self, frame: Frame, *, bulk: bool = False) -> None:
        """Queue a frame (control frames jump ahead of bulk ones). LinkDown if closed."""
        with self._cv:
            if self.closed:
                raise LinkDown(f"link to {self.cluster} is down ({self.reason})")
            (self._data if bulk else self._control).append((frame, self.shaper.stamp()))
            self._bulk_pending += bulk
            self._cv.notify()

    def flush(self, timeout: float) -> bool:
        """Wait until every bulk frame queued so far has been written (False on time-out)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._bulk_pending == 0 or self.closed, timeout)

    def close(self, reason: str) -> None:
        with self._cv:
            if self.closed:
                return
            self.closed = True
            self.reason = reason
            self._control.clear()
            self._data.clear()
            self._bulk_pending = 0
            self._cv.notify_all()
        # wakes both threads; the receiver closes the socket when they are done
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        self._on_close(self, reason)

    def join(self, timeout: float) -> None:
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    def _next(self) -> tuple[Frame, float, bool] | None:
        with self._cv:
            while not self.closed:
                if self._control:
                    return (*self._control.popleft(), False)
                if self._data:
                    return (*self._data.popleft(), True)
                idle = time.monotonic() - self._last_tx
                if idle >= self.heartbeat:
                    break
                self._cv.wait(self.heartbeat - idle)
            else:
                return None
        return Frame(FrameType.HEARTBEAT, encode(self._beat())), time.monotonic(), False

    def _send_loop(self) -> None:
        try:
            while (item := self._next()) is not None:
                frame, stamp, bulk = item
                parts = encode_frame(frame, max_payload=1 << 40)  # own frames: sized by us
                if self.shaper.enabled:
                    n = self.shaper.send(self.io.sendall, parts, stamp)
                else:
                    n = 0
                    for part in parts:
                        self.io.sendall(part)
                        n += memoryview(part).nbytes
                self.bytes_sent += n
                self._last_tx = time.monotonic()
                if bulk:
                    with self._cv:
                        self._bulk_pending = max(0, self._bulk_pending - 1)
                        self._cv.notify_all()
        except (OSError, WireError) as exc:
            self.close(f"send failed: {exc}")
        except Exception as exc:  # noqa: BLE001 (a sender that died would leave the link hung)
            self.close(f"send failed: {type(exc).__name__}: {exc}")

    def _recv_loop(self) -> None:
        watched: Any = _Watched(self)
        try:
            while not self.closed:
                frame = recv_frame(watched, max_payload=self._payload_cap,
                                   alloc=self.buffers.get)
                self.bytes_received += (HEADER_SIZE + len(encode_meta(frame.meta))
                                        + len(frame.payload))
                if frame.type == FrameType.BYE:
                    self.left_job = Goodbye.read(frame.meta).leaving
                    self.close("peer said goodbye")
                    break
                if frame.type == FrameType.ERROR:
                    self.close(f"peer refused: {Refusal.read(frame.meta).reason}")
                    break
                self._on_frame(self, frame)
        except ConnectionClosed as exc:
            self.close(str(exc))
        except (OSError, NebulaError, CodecError, KeyError, TypeError, ValueError) as exc:
            self.close(f"protocol error: {exc}")
        finally:
            self.close("closed")
            self._threads[0].join(5.0)
            self.sock.close()


def peer_addr(sock: socket.socket) -> str:
    """host:port of the other end ("<unknown>" once it is gone)."""
    if sock.family == socket.AF_UNIX:
        return "local socket"
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return "<unknown>"
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def refuse(sock: ssl.SSLSocket, reason: str) -> None:
    """Tell a connection why it is refused (ERROR), then close it (what it still sends read
    and dropped, so that it reads why)."""
    try:
        sock.settimeout(2.0)
        send_frames(sock, [Refusal(reason=reason).to_frame()])
    except (OSError, WireError):
        sock.close()
        return
    close_after_refusal(sock)
