"""Tensors on a connection: the framing both ends of the worker hop (and the relay's peer
fetches) use, on top of :mod:`nebula_cli.relay.net.wire`.

A tensor travels as a header frame (meta with ``numel``, no payload) and then frames of the
same type with meta ``{"lo": offset}`` and up to ``CHUNK_NUMEL`` fp32 elements each, in order.
On the relay's own host (a :class:`~nebula_cli.relay.net.local_socket.LocalSocket`) the header frame
carries a sealed memfd with the tensor's bytes instead, and no chunk frame follows
(:func:`send_tensor` and :func:`recv_tensor` choose by the connection). The receiver states the
largest tensor it accepts (``max_numel``) before anything is allocated or mapped.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Callable
from typing import Any

import torch

from nebula_cli.relay.net.local_socket import LocalSocket, from_memfd, to_memfd
from nebula_cli.relay.net.schema import is_int
from nebula_cli.relay.net.wire import (
    HEADER_SIZE,
    Frame,
    FrameType,
    WireError,
    decode_meta,
    encode_frame,
    parse_header,
)

CHUNK_NUMEL = 4 << 20
"""fp32 elements per frame on the local hop (16 MiB)."""
MAX_TENSOR_NUMEL = 1 << 34
"""The largest tensor a receiver accepts when it knows nothing smaller (a client reading what
its own relay sends); the relay always passes the size it syncs instead."""


def flat_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one flat, contiguous fp32 CPU tensor (itself when it already is one)."""
    return tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()


def tensor_frames(ftype: FrameType, meta: dict[str, Any], tensor: torch.Tensor,
                  chunk_numel: int = CHUNK_NUMEL) -> list[Frame]:
    """A header frame carrying ``meta`` + ``numel``, then the tensor's bytes in chunk frames."""
    flat = flat_fp32(tensor)
    frames = [Frame(ftype, {**meta, "numel": flat.numel()})]
    data = memoryview(flat.numpy()).cast("B")
    for lo in range(0, flat.numel(), chunk_numel):
        hi = min(lo + chunk_numel, flat.numel())
        frames.append(Frame(ftype, {"lo": lo}, data[4 * lo : 4 * hi]))
    return frames


def send_frames(sock: socket.socket, frames: list[Frame]) -> int:
    """sendall every frame (payloads not copied); returns the bytes written."""
    total = 0
    for frame in frames:
        for part in encode_frame(frame):
            sock.sendall(part)
            total += memoryview(part).nbytes
    return total


def send_tensor(conn: Any, ftype: FrameType, meta: dict[str, Any], tensor: torch.Tensor) -> int:
    """Send ``tensor`` as :func:`tensor_frames` lays it out, or on a LocalSocket as one header
    frame with a sealed memfd of its bytes attached (no memfd for an empty tensor). Returns the
    bytes written to the connection."""
    if not isinstance(conn, LocalSocket):
        return send_frames(conn, tensor_frames(ftype, meta, tensor))
    flat = flat_fp32(tensor)
    head = b"".join(encode_frame(Frame(ftype, {**meta, "numel": flat.numel()})))
    if not flat.numel():
        conn.sendall(head)
        return len(head)
    fd = to_memfd(flat)
    try:
        conn.send_with_fd(head, fd)
    finally:
        os.close(fd)
    return len(head)


def check_numel(numel: Any, max_numel: int) -> int:
    """``numel`` if it is an int in [0, max_numel], else WireError saying what was declared."""
    if not is_int(numel) or not 0 <= numel <= max_numel:
        raise WireError(f"bad tensor size {numel!r} (at most {max_numel} elements accepted)")
    return numel


def recv_tensor(sock: socket.socket, ftype: FrameType, numel: int,
                max_numel: int = MAX_TENSOR_NUMEL,
                on_unmap: Callable[[], None] | None = None) -> torch.Tensor:
    """Read the chunk frames of a tensor of ``numel`` elements announced by a header frame
    (on a LocalSocket: map the memfd that came with it; ``on_unmap`` runs once nothing maps it
    any more); nothing is allocated or mapped unless ``numel <= max_numel``."""
    numel = check_numel(numel, max_numel)
    if isinstance(sock, LocalSocket):
        return (from_memfd(sock.take_fd(), numel, sock.seals, on_unmap) if numel
                else torch.empty(0))
    out = torch.empty(numel, dtype=torch.float32)
    dest = memoryview(out.numpy()).cast("B") if numel else memoryview(b"")
    head = bytearray(HEADER_SIZE)
    got = 0
    while got < numel:  # each payload lands in place: no per-frame buffer, no copy
        recv_exact(sock, memoryview(head))
        t, meta_len, payload_len = parse_header(head, max_payload=4 * (numel - got))
        meta = decode_meta(recv_exact(sock, memoryview(bytearray(meta_len))))
        if t != ftype or meta.get("lo") != got:
            raise WireError(f"expected {ftype.name} chunk at element {got}, got {t.name} {meta}")
        if payload_len == 0 or payload_len % 4:
            raise WireError(f"bad chunk of {payload_len} bytes at element {got}")
        recv_exact(sock, dest[4 * got : 4 * got + payload_len])
        got += payload_len // 4
    return out


def recv_exact(sock: socket.socket, view: memoryview) -> memoryview:
    """Fill ``view`` from ``sock`` (WireError if the connection ends first)."""
    n = 0
    while n < len(view):
        try:
            k = sock.recv_into(view[n:], len(view) - n)
        except TimeoutError:
            raise WireError(f"timed out after {n} of {len(view)} bytes") from None
        except ssl.SSLEOFError:
            k = 0
        if not k:
            raise WireError(f"connection closed after {n} of {len(view)} bytes of a frame")
        n += k
    return view
