"""Frames on a relay connection: a fixed binary header, a JSON meta object, a binary payload.

Header (20 bytes, big-endian, struct ``">4sBBHIQ"``)::

    magic        4s  b"NBL1"
    version      B   WIRE_VERSION (1)
    type         B   a FrameType
    flags        H   reserved in version 1: every bit must be 0
    meta_len     I   bytes of UTF-8 JSON after the header; 0 means an empty meta ({})
    payload_len  Q   bytes of payload after the meta

The meta must decode to a JSON object (no NaN/Infinity, no duplicate keys). Every length is
checked against its cap (MAX_META_BYTES; the receiver's ``max_payload``) before any memory is
allocated for it, and the meta is parsed before the payload buffer is allocated. Anything that
breaks these rules raises WireError with the reason; a peer that closes cleanly between frames
raises ConnectionClosed. Sockets are blocking (optionally with a timeout); plain sockets and
ssl.SSLSocket both work.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from nebula_cli.errors import NebulaError

MAGIC = b"NBL1"
WIRE_VERSION = 1
HEADER = struct.Struct(">4sBBHIQ")
HEADER_SIZE = HEADER.size
MAX_META_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD = 256 * 1024 * 1024
COALESCE_BYTES = 64 * 1024
"""Payloads up to this size go out in the same sendall as the header (one segment, no Nagle
stall); larger ones are sent from the caller's buffer without a copy."""
LINGER_S = 2.0
"""How long a connection ended by a refusal reads (and drops) what its peer still sends."""
LINGER_BYTES = 64 * 1024 * 1024
"""How much it reads so: the rest of a refused contribution of 16 M parameters."""

Buffer = bytes | bytearray | memoryview


class WireError(NebulaError):
    """A frame that breaks the wire format, or a connection lost mid-frame. Says why."""


class ConnectionClosed(WireError):
    """The peer closed (or reset) the connection before the first byte of a frame."""


class IdleTimeout(WireError):
    """No byte of a new frame arrived within the socket's timeout. The stream is intact: the
    caller may call recv_frame again (or treat the peer as gone)."""


class FrameType(IntEnum):
    """What a frame is. The meta keys of each type are defined by the relay, not here."""

    HELLO = 1  # first frame on a connection: who the sender is (job, cluster, role, codec)
    WELCOME = 2  # answer to HELLO: accepted, and the receiver's view (round, clusters present)
    HEARTBEAT = 3  # liveness signal on an otherwise idle connection; no payload
    CONTRIB = 4  # one chunk of a cluster's encoded update for a round (worker -> relay)
    RESULT = 5  # one chunk of the averaged update for a round (relay -> worker)
    PEER_CHUNK = 6  # one encoded chunk exchanged between relays during an all-reduce (data only)
    STATE_REQUEST = 7  # ask for the current global state (a cluster that is catching up)
    STATE = 8  # one chunk of a global state (answer to STATE_REQUEST, or published by a worker)
    ERROR = 9  # the sender refuses something; meta["reason"] says what; a close usually follows
    BYE = 10  # orderly goodbye: the sender sends nothing more and closes
    ROUND = 11  # round control between relays (ready / start / behind / abort); no payload
    LABELS_ASK = 12  # token ids a student asks a teacher's soft labels for (relay.distill)
    LABELS = 13  # a teacher's sparse soft labels for one ask (relay.distill.sparse)
    LABELS_FAILED = 14  # an ask that is not answered, and why (relay.distill.messages)


@dataclass
class Frame:
    """One message. ``payload`` is any bytes-like object; received frames carry a bytearray."""

    type: FrameType
    meta: dict[str, Any] = field(default_factory=dict)
    payload: Buffer = b""

    def __post_init__(self) -> None:
        try:
            self.type = FrameType(self.type)
        except ValueError as exc:
            raise WireError(f"unknown frame type {self.type!r}") from exc


def parse_header(
    data: Buffer, *, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> tuple[FrameType, int, int]:
    """Check a HEADER_SIZE-byte header: (type, meta_len, payload_len), or WireError."""
    if len(data) != HEADER_SIZE:
        raise WireError(f"header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, ftype, flags, meta_len, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a nebula relay peer")
    if version != WIRE_VERSION:
        raise WireError(f"unsupported wire version {version} (this side speaks {WIRE_VERSION})")
    try:
        frame_type = FrameType(ftype)
    except ValueError:
        raise WireError(f"unknown frame type {ftype}") from None
    if flags:
        raise WireError(f"reserved flag bits set (0x{flags:04x})")
    if meta_len > MAX_META_BYTES:
        raise WireError(f"meta of {meta_len} bytes exceeds the cap of {MAX_META_BYTES}")
    if payload_len > max_payload:
        raise WireError(f"payload of {payload_len} bytes exceeds the cap of {max_payload}")
    return frame_type, meta_len, payload_len


def _reject_constant(name: str) -> Any:
    raise WireError(f"meta contains {name}, which is not JSON")


def _object_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise WireError("meta has a duplicate key")
    return obj


def decode_meta(data: Buffer) -> dict[str, Any]:
    """Parse a meta part: empty -> {}, else strict UTF-8 JSON that must be an object."""
    if not len(data):
        return {}
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"meta is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(
            text, object_pairs_hook=_object_no_duplicates, parse_constant=_reject_constant
        )
    except RecursionError:
        raise WireError("meta is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and integers too long to convert
        raise WireError(f"meta is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError(f"meta must be a JSON object, got {type(obj).__name__}")
    return obj


def encode_meta(meta: dict[str, Any]) -> bytes:
    """Serialise a meta dict (empty -> b""); raises WireError if it is not a JSON object or is
    larger than MAX_META_BYTES. Non-ASCII text is escaped, so any str round-trips."""
    if not isinstance(meta, dict):
        raise WireError(f"meta must be a dict, got {type(meta).__name__}")
    if not meta:
        return b""
    if not all(isinstance(k, str) for k in meta):
        raise WireError("meta keys must be strings")
    try:
        data = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode("ascii")
    except (TypeError, ValueError, RecursionError) as exc:
        raise WireError(f"meta is not JSON-serialisable: {exc}") from None
    if len(data) > MAX_META_BYTES:
        raise WireError(f"meta of {len(data)} bytes exceeds the cap of {MAX_META_BYTES}")
    return data


def _byte_view(payload: Buffer) -> memoryview:
    try:
        view = memoryview(payload)
    except TypeError:
        raise WireError(f"payload must be bytes-like, got {type(payload).__name__}") from None
    if not view.c_contiguous:
        raise WireError("payload must be a contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def encode_frame(
    frame: Frame, *, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> list[bytes | memoryview]:
    """[header + meta, payload view]: the bytes of a frame, the payload not copied."""
    meta = encode_meta(frame.meta)
    payload = _byte_view(frame.payload)
    if payload.nbytes > max_payload:
        raise WireError(f"payload of {payload.nbytes} bytes exceeds the cap of {max_payload}")
    head = HEADER.pack(MAGIC, WIRE_VERSION, int(frame.type), 0, len(meta), payload.nbytes)
    return [head + meta, payload]


def send_frame(sock: socket.socket, frame: Frame, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> int:
    """Send one frame with sendall (header and meta, then the payload without a copy; small
    payloads go in the same call). Returns the bytes sent. Socket errors become WireError
    (ConnectionClosed when the peer is gone)."""
    head, payload = encode_frame(frame, max_payload=max_payload)
    try:
        if payload.nbytes <= COALESCE_BYTES:
            sock.sendall(head + payload)
        else:
            sock.sendall(head)
            sock.sendall(payload)
    except TimeoutError:
        raise WireError("timed out while sending a frame") from None
    except ssl.SSLError as exc:
        raise WireError(f"TLS error while sending a frame: {exc}") from exc
    except OSError as exc:
        raise ConnectionClosed(f"connection lost while sending a frame: {exc}") from exc
    return len(head) + payload.nbytes


def _recv_exact(sock: socket.socket, buf: bytearray, what: str, *, frame_start: bool) -> None:
    """Fill buf from sock with recv_into. frame_start: nothing of this frame was read yet."""
    view = memoryview(buf)
    want = len(buf)
    got = 0
    while got < want:
        idle = frame_start and got == 0
        try:
            n = sock.recv_into(view[got:], want - got)
        except TimeoutError:
            if idle:
                raise IdleTimeout("no frame arrived before the socket timeout") from None
            raise WireError(f"timed out after {got} of {want} bytes of the {what}") from None
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            n = 0
        except ssl.SSLError as exc:
            raise WireError(f"TLS error while reading the {what}: {exc}") from exc
        except OSError as exc:
            if idle:
                raise ConnectionClosed(f"connection lost: {exc}") from exc
            raise WireError(
                f"truncated frame: connection lost after {got} of {want} bytes of the {what}: {exc}"
            ) from exc
        if n == 0:
            if idle:
                raise ConnectionClosed("connection closed by peer")
            raise WireError(
                f"truncated frame: connection closed after {got} of {want} bytes of the {what}"
            )
        got += n


def recv_frame(sock: socket.socket, *,
               max_payload: int | Callable[[], int] = DEFAULT_MAX_PAYLOAD,
               alloc: Callable[[int], bytearray] = bytearray) -> Frame:
    """Read exactly one frame. Header checked first, then the meta read and parsed, then the
    payload read into a bytearray of exactly the declared size (recv_into, no extra copies;
    ``alloc(n)`` makes it: e.g. a relay.buffers.BufferPool's ``get``)."""
    header = bytearray(HEADER_SIZE)
    _recv_exact(sock, header, "header", frame_start=True)
    if callable(max_payload):  # the cap as of this frame's arrival, not of the wait's start
        max_payload = max_payload()
    ftype, meta_len, payload_len = parse_header(header, max_payload=max_payload)
    meta_raw = bytearray(meta_len)
    _recv_exact(sock, meta_raw, "meta", frame_start=False)
    meta = decode_meta(meta_raw)
    payload = alloc(payload_len)
    _recv_exact(sock, payload, "payload", frame_start=False)
    return Frame(ftype, meta, payload)


def recv_small_frame(sock: socket.socket, max_bytes: int) -> Frame:
    """Read one frame without payload of at most ``max_bytes`` in all (header and meta), for
    a connection that is not authenticated yet: nothing larger is read or allocated."""
    header = bytearray(HEADER_SIZE)
    _recv_exact(sock, header, "header", frame_start=True)
    ftype, meta_len, _ = parse_header(header, max_payload=0)
    if HEADER_SIZE + meta_len > max_bytes:
        raise WireError(f"a first frame of {HEADER_SIZE + meta_len} bytes; at most {max_bytes} "
                        "are read before the peer is authenticated")
    meta_raw = bytearray(meta_len)
    _recv_exact(sock, meta_raw, "meta", frame_start=False)
    return Frame(ftype, decode_meta(meta_raw))


class FrameDecoder:
    """Incremental parser for bytes that arrive in arbitrary pieces: ``feed(data)`` returns the
    frames completed by data; ``eof()`` says the stream ended (WireError if mid-frame). Memory
    held is at most one header, one meta (<= MAX_META_BYTES) and one payload (<= max_payload),
    each allocated only after its length was checked. After a WireError the decoder is spent
    (the stream cannot be resynchronised); frames completed earlier in that same feed call are
    dropped."""

    def __init__(self, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        self._failed: WireError | None = None
        self._reset()

    def _reset(self) -> None:
        self._part = "header"
        self._buf = bytearray(HEADER_SIZE)
        self._got = 0
        self._type: FrameType | None = None
        self._meta: dict[str, Any] = {}
        self._payload_len = 0

    @property
    def in_frame(self) -> bool:
        """True when part of a frame has been fed but not all of it."""
        return self._part != "header" or self._got > 0

    def feed(self, data: Buffer) -> list[Frame]:
        if self._failed is not None:
            raise WireError(f"decoder unusable after an earlier error: {self._failed}")
        view = _byte_view(data)
        frames: list[Frame] = []
        pos, end = 0, view.nbytes
        try:
            while True:
                room = len(self._buf) - self._got
                if room:
                    take = min(room, end - pos)
                    if take == 0:
                        break
                    self._buf[self._got : self._got + take] = view[pos : pos + take]
                    self._got += take
                    pos += take
                    if take < room:
                        break
                frame = self._part_done()
                if frame is not None:
                    frames.append(frame)
        except WireError as exc:
            self._failed = exc
            raise
        return frames

    def _part_done(self) -> Frame | None:
        if self._part == "header":
            self._type, meta_len, self._payload_len = parse_header(
                self._buf, max_payload=self.max_payload
            )
            self._part, self._buf, self._got = "meta", bytearray(meta_len), 0
            return None
        if self._part == "meta":
            self._meta = decode_meta(self._buf)
            self._part, self._buf, self._got = "payload", bytearray(self._payload_len), 0
            return None
        frame = Frame(self._type, self._meta, self._buf)  # type: ignore[arg-type]
        self._reset()
        return frame

    def eof(self) -> None:
        """The stream ended. Raises WireError if it ended inside a frame (or after an error)."""
        if self._failed is not None:
            raise WireError(f"decoder unusable after an earlier error: {self._failed}")
        if self.in_frame:
            raise WireError(
                f"truncated frame: stream ended after {self._got} of {len(self._buf)} bytes "
                f"of the {self._part}"
            )


def tune_socket(sock: socket.socket) -> None:
    """Set TCP_NODELAY on a TCP socket (frames are written whole; Nagle only adds latency).

    The kernel's buffer sizes are left alone on purpose: a fixed SO_RCVBUF/SO_SNDBUF turns off
    TCP's autotuning, and on a stock host (net.core.rmem_max 208 KiB) it would cap the window
    at about 416 KiB, 33 Mbit/s at 100 ms of round trip; autotuning grows it to tcp_rmem's
    maximum (6 MiB by default) as a long fat WAN link needs."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def close_after_refusal(sock: Any, *, seconds: float = LINGER_S, most: int = LINGER_BYTES) -> None:
    """Close a connection whose last frame (a refusal) was just sent, without losing that frame.

    Closed at once while the peer's bytes lie unread (the rest of a refused request), a socket
    is reset: the peer's next send then fails (over TLS: "EOF occurred in violation of
    protocol") before it reads why it was refused. So this side ends first (its FIN after the
    refusal), reads and drops what the peer still sends until the peer closes, for at most
    ``seconds`` and ``most`` bytes, then closes. A plain or TLS socket (read beneath TLS:
    nothing more is decrypted) or a connection holding one as ``.sock`` (a Unix socket's)."""
    raw: socket.socket = getattr(sock, "sock", sock)
    deadline = time.monotonic() + seconds
    try:
        socket.socket.shutdown(raw, socket.SHUT_WR)
        buf = bytearray(64 * 1024)
        read = 0
        while read < most:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            socket.socket.settimeout(raw, left)
            n = socket.socket.recv_into(raw, buf)
            if not n:
                break
            read += n
    except OSError:
        pass
    finally:
        sock.close()
