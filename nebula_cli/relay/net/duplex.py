"""One TLS socket shared by a reader thread and a writer thread, safely.

OpenSSL forbids calling ``SSL_read`` and ``SSL_write`` on the same connection from two threads
at once, and CPython before 3.13 does not serialise them (concurrent ``recv``/``send`` on one
``SSLSocket`` can corrupt the connection or crash the interpreter: cpython#151508). A relay's
peer link reads and writes at the same time (both relays send their update to each other), so
:class:`DuplexTLS` makes the socket non-blocking, runs every OpenSSL call under one lock, and
waits for the socket to become readable or writable *outside* the lock: a writer blocked by a
full send buffer never keeps the reader from draining the other direction (which would
deadlock two relays sending large updates to each other).

A write interrupted by a full buffer is retried with the same bytes, as OpenSSL requires
(Python sets ``SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER``).
"""

from __future__ import annotations

import select
import ssl
import threading
from typing import Any

WRITE_PIECE = 256 * 1024
"""Bytes handed to one SSL_write (records are 16 KiB; larger pieces mean fewer lock rounds)."""
POLL_S = 1.0
"""Longest wait for readiness before trying again (a shut-down socket wakes waits at once)."""


class DuplexTLS:
    """``recv_into`` and ``sendall`` for one reader and one writer thread on a TLS socket."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._lock = threading.Lock()

    def recv_into(self, buf: Any, nbytes: int = 0) -> int:
        """Read at most `nbytes` (0: len(buf)) into `buf`; 0 at end of stream. Blocks until some
        data arrives."""
        while True:
            with self._lock:
                try:
                    return self.sock.recv_into(buf, nbytes)
                except ssl.SSLWantReadError:
                    want_write = False
                except ssl.SSLWantWriteError:  # a TLS 1.2 renegotiation, not in TLS 1.3
                    want_write = True
            self._wait(write=want_write)

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        """Write all of `data`; blocks while the send buffer is full."""
        view = memoryview(data).cast("B")
        while view:
            piece = view[:WRITE_PIECE]
            while True:
                with self._lock:
                    try:
                        sent = self.sock.send(piece)
                        break
                    except ssl.SSLWantWriteError:
                        want_write = True
                    except ssl.SSLWantReadError:
                        want_write = False
                self._wait(write=want_write)  # then retry the same piece
            view = view[sent:]

    def _wait(self, *, write: bool) -> None:
        fd = self.sock.fileno()
        if fd < 0:
            raise OSError("the TLS socket is closed")
        if write:
            select.select([], [fd], [fd], POLL_S)
        else:
            select.select([fd], [], [fd], POLL_S)
