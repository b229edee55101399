"""Raw wire frames for tests: a header, raw bytes, connected socket pairs."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from nebula_cli.relay.net.wire import (
    HEADER,
    MAGIC,
    WIRE_VERSION,
    Frame,
    encode_frame,
)


def header(
    ftype: int = 1,
    meta_len: int = 0,
    payload_len: int = 0,
    *,
    magic: bytes = MAGIC,
    version: int = WIRE_VERSION,
    flags: int = 0,
) -> bytes:
    return HEADER.pack(magic, version, ftype, flags, meta_len, payload_len)


def raw(frame: Frame) -> bytes:
    return b"".join(bytes(part) for part in encode_frame(frame))


@contextmanager
def socket_pair(timeout: float = 5.0) -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(timeout)
    b.settimeout(timeout)
    try:
        yield a, b
    finally:
        a.close()
        b.close()
