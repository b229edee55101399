"""relay/net/wire.py: frames round-trip exactly; anything else is refused with a reason, before any
large allocation, over plain sockets, socketpairs and TLS."""

from __future__ import annotations

import socket
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from helpers.wire_frames import header, raw, socket_pair
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nebula_cli.errors import NebulaError
from nebula_cli.relay.net.wire import (
    HEADER_SIZE,
    MAGIC,
    MAX_META_BYTES,
    ConnectionClosed,
    Frame,
    FrameDecoder,
    FrameType,
    WireError,
    encode_frame,
    recv_frame,
    send_frame,
)

SMALL_CAP = 4096  # max_payload used by the property tests
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOCKETS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- helpers


@contextmanager
def peak_allocation() -> Iterator[Callable[[], int]]:
    """Yields a function returning the peak bytes allocated by Python since entry."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield lambda: tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def drain(sock: socket.socket, max_payload: int) -> tuple[list[Frame], BaseException]:
    """recv_frame until it raises; returns the frames and the exception."""
    frames = []
    while True:
        try:
            frames.append(recv_frame(sock, max_payload=max_payload))
        except Exception as exc:  # the test inspects what was raised
            return frames, exc


# ---------------------------------------------------------------------------- strategies

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
metas = st.dictionaries(st.text(max_size=12), json_values, max_size=5)
frames = st.builds(Frame, st.sampled_from(list(FrameType)), metas, st.binary(max_size=600))
# Bytes that get past the magic more often than uniform noise would.
header_like = st.builds(
    lambda t, f, m, p, tail: header(t, m, p, flags=f) + tail,
    st.integers(0, 255),
    st.sampled_from([0, 0, 0, 1, 0x8000]),
    st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1)),
    st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)),
    st.binary(max_size=200),
)
noise = st.one_of(st.binary(max_size=300), header_like, st.builds(lambda b: MAGIC + b, st.binary()))


# ---------------------------------------------------------------------------- format


def test_header_layout_is_fixed() -> None:
    data = raw(Frame(FrameType.CONTRIB, {"round": 3}, b"\x01\x02"))
    meta = b'{"round":3}'
    assert HEADER_SIZE == 20
    assert (
        data
        == b"NBL1" + bytes([1, 4]) + b"\0\0" + struct.pack(">IQ", len(meta), 2) + meta + b"\1\2"
    )
    assert raw(Frame(FrameType.HEARTBEAT)) == b"NBL1\x01\x03" + bytes(14)  # empty meta: 0 bytes


def test_every_frame_type_is_documented_and_distinct() -> None:
    names = {t.name for t in FrameType}
    assert names == {
        "HELLO",
        "WELCOME",
        "HEARTBEAT",
        "CONTRIB",
        "RESULT",
        "PEER_CHUNK",
        "STATE_REQUEST",
        "STATE",
        "ERROR",
        "BYE",
        "ROUND",
        "LABELS_ASK",
        "LABELS",
        "LABELS_FAILED",
    }
    assert len({int(t) for t in FrameType}) == len(names) and 0 not in {int(t) for t in FrameType}
    assert issubclass(WireError, NebulaError) and issubclass(ConnectionClosed, WireError)


def test_payload_is_not_copied_by_encode_frame() -> None:
    big = bytearray(1 << 20)
    parts = encode_frame(Frame(FrameType.STATE, {}, big))
    assert isinstance(parts[1], memoryview) and parts[1].obj is big
    floats = memoryview(bytearray(16)).cast("f")  # non-byte formats are sent as their bytes
    assert encode_frame(Frame(FrameType.STATE, {}, floats))[1].nbytes == 16


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"NBL2" + header()[4:], "bad magic"),
        (header(version=2), "unsupported wire version 2"),
        (header(ftype=0), "unknown frame type 0"),
        (header(ftype=99), "unknown frame type 99"),
        (header(flags=1), "reserved flag bits"),
        (header(meta_len=MAX_META_BYTES + 1), "meta of 65537 bytes exceeds the cap"),
        (header(payload_len=2**60), f"payload of {2**60} bytes exceeds the cap"),
        (header(meta_len=2) + b"\xff\xfe", "not valid UTF-8"),
        (header(meta_len=3) + b"{a}", "not valid JSON"),
        (header(meta_len=3) + b"[1]", "must be a JSON object, got list"),
        (header(meta_len=4) + b'"hi"', "must be a JSON object, got str"),
        (header(meta_len=11) + b'{"a":NaN}  ', "NaN"),
        (header(meta_len=13) + b'{"a":1,"a":2}', "duplicate key"),
        (header(meta_len=60000) + b"[" * 60000, "nested too deeply"),
    ],
)
def test_bad_frames_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        FrameDecoder(max_payload=SMALL_CAP).feed(data)
    with socket_pair() as (a, b):
        a.sendall(data)  # the connection stays open: refusal must not wait for more bytes
        with pytest.raises(WireError, match=reason):
            recv_frame(b, max_payload=SMALL_CAP)


def test_sender_refuses_what_a_receiver_would_refuse() -> None:
    with pytest.raises(WireError, match="exceeds the cap"):
        encode_frame(Frame(FrameType.CONTRIB, {}, bytes(101)), max_payload=100)
    with pytest.raises(WireError, match="not JSON-serialisable"):
        encode_frame(Frame(FrameType.HELLO, {"x": float("nan")}))
    with pytest.raises(WireError, match="not JSON-serialisable"):
        encode_frame(Frame(FrameType.HELLO, {"x": object()}))
    with pytest.raises(WireError, match="keys must be strings"):
        encode_frame(Frame(FrameType.HELLO, {1: "x"}))  # type: ignore[dict-item]
    with pytest.raises(WireError, match="meta of"):
        encode_frame(Frame(FrameType.HELLO, {"x": "a" * MAX_META_BYTES}))
    with pytest.raises(WireError, match="must be a dict"):
        encode_frame(Frame(FrameType.HELLO, ["x"]))  # type: ignore[arg-type]
    with pytest.raises(WireError, match="unknown frame type 42"):
        Frame(42)  # type: ignore[arg-type]


def test_huge_declared_lengths_are_refused_without_allocating() -> None:
    for data in (
        header(payload_len=2**60),
        header(meta_len=2**32 - 1),
        header(meta_len=2, payload_len=2**64 - 1) + b"{}",
    ):
        with peak_allocation() as peak:
            with pytest.raises(WireError, match="exceeds the cap"):
                FrameDecoder().feed(data)
            assert peak() < 64 * 1024
        with socket_pair() as (a, b), peak_allocation() as peak:
            a.sendall(data)
            start = time.monotonic()
            with pytest.raises(WireError, match="exceeds the cap"):
                recv_frame(b)
            assert time.monotonic() - start < 1.0
            assert peak() < 64 * 1024


# ---------------------------------------------------------------------------- properties


@FAST
@given(st.lists(frames, max_size=5), st.lists(st.integers(0, 5000), max_size=8))
def test_frames_round_trip_through_the_decoder_in_any_pieces(
    fs: list[Frame], cuts: list[int]
) -> None:
    data = b"".join(raw(f) for f in fs)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    decoder = FrameDecoder(max_payload=SMALL_CAP)
    out: list[Frame] = []
    for lo, hi in zip(points, points[1:], strict=False):
        out.extend(decoder.feed(data[lo:hi]))
    decoder.eof()
    assert out == fs
    assert all(type(f.type) is FrameType and isinstance(f.payload, bytearray) for f in out)


@SOCKETS
@given(st.lists(frames, max_size=4))
def test_frames_round_trip_over_a_socketpair(fs: list[Frame]) -> None:
    with socket_pair() as (a, b):
        sent = sum(send_frame(a, f) for f in fs)
        a.shutdown(socket.SHUT_WR)
        got, exc = drain(b, SMALL_CAP)
    assert got == fs
    assert type(exc) is ConnectionClosed  # clean EOF between frames
    assert sent == sum(len(raw(f)) for f in fs)


@FAST
@given(noise, st.integers(1, 64))
def test_decoder_on_arbitrary_bytes_raises_only_wire_errors_within_caps(
    data: bytes, piece: int
) -> None:
    decoder = FrameDecoder(max_payload=SMALL_CAP)
    with peak_allocation() as peak:
        try:
            for i in range(0, len(data), piece):
                for f in decoder.feed(data[i : i + piece]):
                    assert len(f.payload) <= SMALL_CAP
            decoder.eof()
        except WireError as exc:
            assert str(exc)  # every refusal says why
        assert peak() < MAX_META_BYTES + SMALL_CAP + 32 * 1024


@SOCKETS
@given(noise)
def test_recv_frame_on_arbitrary_bytes_raises_only_wire_errors_within_caps(data: bytes) -> None:
    with socket_pair() as (a, b):
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        with peak_allocation() as peak:
            got, exc = drain(b, SMALL_CAP)
            assert peak() < MAX_META_BYTES + SMALL_CAP + 32 * 1024
    assert isinstance(exc, WireError), repr(exc)
    assert all(len(f.payload) <= SMALL_CAP for f in got)


@FAST
@given(frames, st.data())
def test_truncated_frames_are_errors_not_clean_closes(frame: Frame, data: st.DataObject) -> None:
    full = raw(frame)
    cut = data.draw(st.integers(0, len(full) - 1))
    decoder = FrameDecoder(max_payload=SMALL_CAP)
    assert decoder.feed(full[:cut]) == []
    with socket_pair() as (a, b):
        a.sendall(full[:cut])
        a.shutdown(socket.SHUT_WR)
        if cut == 0:
            decoder.eof()  # nothing started: a clean end
            with pytest.raises(ConnectionClosed):
                recv_frame(b, max_payload=SMALL_CAP)
            return
        with pytest.raises(WireError, match="truncated"):
            decoder.eof()
        with pytest.raises(WireError, match="truncated") as info:
            recv_frame(b, max_payload=SMALL_CAP)
        assert not isinstance(info.value, ConnectionClosed)


def test_decoder_is_spent_after_an_error() -> None:
    decoder = FrameDecoder()
    with pytest.raises(WireError, match="bad magic"):
        decoder.feed(b"JUNKJUNKJUNKJUNKJUNK")
    with pytest.raises(WireError, match="unusable"):
        decoder.feed(raw(Frame(FrameType.BYE)))
