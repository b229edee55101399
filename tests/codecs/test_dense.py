"""The dense codecs (codecs/none/, half/, int8/ codec.py; and topk through the relay's registry,
feedback, chunks): every codec
round-trips within its stated bound, refuses poison and corrupt encodings, and error feedback
keeps the sum of what was sent on track."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nebula_cli.codecs.int8.codec import INT8_FLUSH_BELOW, Int8Codec
from nebula_cli.codecs.int8.params import Int8Params
from nebula_cli.errors import NebulaError
from nebula_cli.relay.codecs.base import Codec, CodecError, Encoded
from nebula_cli.relay.codecs.chunks import chunk_spans, iter_chunks
from nebula_cli.relay.codecs.feedback import ErrorFeedback
from nebula_cli.relay.codecs.registry import CODECS, KNOWN_CODECS, decode, get_codec

DEFAULT_BLOCK_SIZE = Int8Params.block_size

SIZES = [0, 1, 255, 256, 257, 10_000]
KINDS = ["randn", "zeros", "wide", "special"]
STATED = {  # the bounds the module documents, recomputed here independently (float64)
    "fp16": (2.0**-11, 2.0**-25, 65504.0),
    "bf16": (2.0**-8, 2.0**-134, 3.3895313892515355e38),
}


def make(name: str, size: int, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + size)
    if kind == "randn":
        return torch.randn(size, generator=g) * 0.01
    if kind == "zeros":
        return torch.zeros(size)
    sign = torch.where(torch.rand(size, generator=g) < 0.5, -1.0, 1.0).double()
    if kind == "wide":  # magnitudes spread over the codec's whole range inside every block
        lo, hi = (-9.0, 4.8) if name == "fp16" else (-37.0, 38.0)
        exp = lo + (hi - lo) * torch.rand(size, generator=g).double()
        return (sign * torch.pow(10.0, exp)).float()
    top = 65504.0 if name == "fp16" else 3.0e38
    special = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, top, -top, 1e-40, -1e-45, 2.0**-24, 2.0**-25, 6.1e-5, 0.1, 1 / 3]
    )
    return special[torch.randint(len(special), (size,), generator=g)]


def errors(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (y.double() - x.double()).abs()


def int8_stated_bound(x: torch.Tensor, bs: int) -> torch.Tensor:
    xd = x.double()
    pad = (-len(xd)) % bs
    absmax = torch.cat([xd.abs(), xd.new_zeros(pad)]).view(-1, bs).amax(1)
    bound = torch.where(absmax >= INT8_FLUSH_BELOW, absmax / 254 * (1 + 2.0**-12), absmax)
    return bound.repeat_interleave(bs)[: len(xd)]


def topk_stated_bound(x: torch.Tensor, bits: int = 2) -> torch.Tensor:
    xd = x.double()
    pad = (-len(xd)) % 1024
    absmax = torch.cat([xd.abs(), xd.new_zeros(pad)]).view(-1, 1024).amax(1)
    kept = absmax * (1 / (2**bits - 2) + 2.0**-7) * (1 + 2.0**-12)
    kept = kept.repeat_interleave(1024)[: len(xd)]
    return torch.maximum(xd.abs(), kept)


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", KNOWN_CODECS)
def test_round_trip_within_the_stated_bound(name: str, size: int, kind: str) -> None:
    codec = get_codec(name)
    x = make(name, size, kind)
    enc = codec.encode(x)
    assert (enc.codec, enc.numel) == (name, size)
    assert enc.nbytes == codec.payload_nbytes(size)
    y = codec.decode(enc)
    assert y.dtype == torch.float32 and y.shape == (size,)
    err = errors(x, y)
    assert bool((err <= codec.max_abs_error(x).double()).all())
    if name == "none":
        assert torch.equal(y.view(torch.int32), x.view(torch.int32))  # bit for bit, -0.0 too
    elif name in STATED:
        rel, tiny, _ = STATED[name]
        assert bool((err <= torch.clamp(x.double().abs() * rel, min=tiny)).all())
    elif name == "topk":
        assert bool((err <= topk_stated_bound(x)).all())
    else:
        assert bool((err <= int8_stated_bound(x, DEFAULT_BLOCK_SIZE)).all())
    if kind == "zeros":
        assert not y.any()
    # Through a frame's meta with a read-only bytes payload, and through the module's decode.
    again = Encoded.from_wire({**enc.wire_meta(), "round": 7}, bytes(enc.payload))
    assert torch.equal(decode(again), y)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=700),
    st.integers(1, 300),
)
def test_arbitrary_finite_floats_round_trip_within_bounds(values: list[float], bs: int) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    for name in KNOWN_CODECS:
        codec = get_codec(name, block_size=bs)
        range_of = "bf16" if name == "topk" else name  # topk's scales are bfloat16
        if range_of in STATED and values and float(x.abs().max()) > STATED[range_of][2]:
            with pytest.raises(CodecError, match="beyond the codec's range"):
                codec.encode(x)
            continue
        y = codec.decode(codec.encode(x))
        assert bool((errors(x, y) <= codec.max_abs_error(x).double()).all())
        if name == "int8":
            assert bool((errors(x, y) <= int8_stated_bound(x, bs)).all())


def test_int8_layout_partial_and_zero_blocks() -> None:
    codec = Int8Codec(block_size=4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5, 0.0, 3.0])  # zero, full, partial block
    enc = codec.encode(x)
    assert enc.meta == {"block_size": 4} and enc.nbytes == 3 * 4 + 9
    scales = struct.unpack("<3f", bytes(enc.payload[:12]))
    assert scales[0] == 0.0
    assert scales[1] == pytest.approx(2 / 127) and scales[2] == pytest.approx(3 / 127)
    q = list(struct.unpack("<9b", bytes(enc.payload[12:])))
    assert q == [0, 0, 0, 0, 64, -127, 32, 0, 127]  # round(1 * 127/2) = 64 (63.5, half to even)
    y = codec.decode(enc)
    assert y[:4].eq(0).all() and y[8] == pytest.approx(3.0) and y[5] == pytest.approx(-2.0)


def test_int8_tiny_blocks_are_sent_as_zeros_within_bound() -> None:
    codec = get_codec("int8")
    x = torch.cat([torch.full((256,), 1e-38), torch.full((256,), 1e-3)])
    y = codec.decode(codec.encode(x))
    assert not y[:256].any() and torch.allclose(y[256:], x[256:])
    assert bool((errors(x, y) <= codec.max_abs_error(x).double()).all())


@pytest.mark.parametrize("name", KNOWN_CODECS)
def test_other_float_dtypes_and_shapes_are_converted_to_flat_fp32(name: str) -> None:
    codec = get_codec(name)
    x32 = torch.randn(3, 100)
    for x in (x32.bfloat16(), x32.half(), x32.double(), x32.t()):
        enc = codec.encode(x)
        ref = codec.encode(x.float().reshape(-1))
        assert enc.numel == 300 and bytes(enc.payload) == bytes(ref.payload)
    assert codec.decode(codec.encode(x32.bfloat16())).shape == (300,)
    for bad in (torch.arange(5), torch.ones(3, dtype=torch.bool), [1.0, 2.0]):
        with pytest.raises(CodecError, match="expected a"):
            codec.encode(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("size", [1, 257, 10_000])
@pytest.mark.parametrize("name", KNOWN_CODECS)
def test_non_finite_input_is_refused(name: str, size: int, bad: float) -> None:
    codec = get_codec(name)
    for pos in {0, size // 2, size - 1}:
        x = torch.randn(size)
        x[pos] = bad
        with pytest.raises(CodecError, match="NaN or infinite"):
            codec.encode(x)
    ef = ErrorFeedback(codec)
    ef.encode(torch.ones(size), "k")
    before = ef.residual("k").clone()  # type: ignore[union-attr]
    with pytest.raises(CodecError):
        ef.encode(x, "k")
    assert torch.equal(ef.residual("k"), before)  # a refused round leaves the residual alone


def test_values_beyond_a_codecs_range_are_refused() -> None:
    fp16, bf16 = get_codec("fp16"), get_codec("bf16")
    assert fp16.decode(fp16.encode(torch.tensor([65504.0, -65504.0]))).abs().eq(65504).all()
    for v in (65505.0, -1e5):
        with pytest.raises(CodecError, match="beyond the codec's range"):
            fp16.encode(torch.tensor([0.0, v]))
    fmax = torch.finfo(torch.float32).max
    with pytest.raises(CodecError, match="beyond the codec's range"):
        bf16.encode(torch.tensor([fmax]))
    for name in ("none", "int8"):
        codec = get_codec(name)
        y = codec.decode(codec.encode(torch.tensor([fmax, -fmax, 1.0])))
        assert bool(torch.isfinite(y).all()) and y[0] == pytest.approx(fmax, rel=1e-6)


def _corruptions(enc: Encoded) -> list[tuple[Encoded, str]]:
    p = bytes(enc.payload)
    bad = [
        (Encoded(enc.codec, enc.numel, enc.meta, p + b"\0"), "payload of"),
        (Encoded(enc.codec, -1, enc.meta, p), "non-negative integer"),
        (Encoded(enc.codec, True, enc.meta, p), "non-negative integer"),  # type: ignore[arg-type]
        (Encoded(enc.codec, enc.numel, None, p), "meta must be a mapping"),  # type: ignore[arg-type]
        (Encoded(enc.codec, enc.numel, enc.meta, [1, 2]), "not bytes-like"),  # type: ignore[arg-type]
    ]
    if get_codec(enc.codec).payload_nbytes(enc.numel + 1, enc.meta) != len(p):  # topk: may not
        bad.append((Encoded(enc.codec, enc.numel + 1, enc.meta, p), "payload of"))
    if p:
        bad.append((Encoded(enc.codec, enc.numel, enc.meta, p[:-1]), "payload of"))
    if enc.numel and get_codec(enc.codec).payload_nbytes(enc.numel - 1, enc.meta) != len(p):
        bad.append((Encoded(enc.codec, enc.numel - 1, enc.meta, p), "payload of"))
    if enc.codec == "int8":
        for meta in (
            {},
            {"block_size": 0},
            {"block_size": -1},
            {"block_size": "256"},
            {"block_size": True},
            {"block_size": 2**21},
            {"block_size": 256, "x": 1},
        ):
            bad.append((Encoded(enc.codec, enc.numel, meta, p), "block_size"))
        if enc.numel > 128:  # here a different block size implies a different payload length
            bad.append((Encoded(enc.codec, enc.numel, {"block_size": 128}, p), "payload of"))
    elif enc.codec == "topk":
        good = dict(enc.meta)
        for change in ({"span": None}, {"k": None}, {"k": 0}, {"k": good["span"] + 1},
                       {"bits": 3}, {"k": "5"}, {"span": 48}, {"span": 8192},
                       {"span": True}, {"x": 1}):
            meta = {**good, **change}
            meta = {key: v for key, v in meta.items() if v is not None}
            bad.append((Encoded(enc.codec, enc.numel, meta, p), "topk: (meta|k|bits|span)"))
        if enc.numel > 1:  # more kept per span: a longer payload
            more = {**good, "k": good["k"] + 1}
            bad.append((Encoded(enc.codec, enc.numel, more, p), "payload of"))
    else:
        bad.append((Encoded(enc.codec, enc.numel, {"block_size": 256}, p), "unexpected meta"))
    return bad


@pytest.mark.parametrize("size", [0, 1, 257, 1000])
@pytest.mark.parametrize("name", KNOWN_CODECS)
def test_corrupt_encodings_are_refused(name: str, size: int) -> None:
    codec = get_codec(name)
    enc = codec.encode(torch.randn(size))
    for bad, reason in _corruptions(enc):
        with pytest.raises(CodecError, match=reason):
            codec.decode(bad)
    other = "int8" if name != "int8" else "fp16"
    with pytest.raises(CodecError, match=f"encoded with '{name}', not '{other}'"):
        get_codec(other).decode(enc)
    for meta, reason in (
        ({"codec": 1, "numel": 1}, "'codec'"),
        ({"codec": name, "numel": "3"}, "'numel'"),
        ({"codec": name, "numel": 3, "codec_meta": []}, "'codec_meta'"),
    ):
        with pytest.raises(CodecError, match=reason):
            Encoded.from_wire(meta, b"")


def test_non_finite_payloads_decode_as_is_or_are_refused_on_request() -> None:
    inf16 = Encoded("fp16", 2, {}, struct.pack("<2e", 1.0, math.inf))
    assert math.isinf(decode(inf16)[1])  # the relay decides what to do with it
    with pytest.raises(CodecError, match="non-finite"):
        decode(inf16, check_finite=True)
    nan_scale = Encoded("int8", 2, {"block_size": 256}, struct.pack("<f2b", math.nan, 1, 2))
    with pytest.raises(CodecError, match="non-finite"):
        decode(nan_scale, check_finite=True)


def test_decode_into_a_slice_of_a_bigger_tensor() -> None:
    codec = get_codec("int8")
    x = torch.randn(1000)
    result = torch.full((3000,), 7.0)
    codec.decode(codec.encode(x), out=result[1000:2000])
    assert torch.equal(result[1000:2000], codec.decode(codec.encode(x)))
    assert result[:1000].eq(7).all() and result[2000:].eq(7).all()
    for out in (torch.empty(999), torch.empty(1000, dtype=torch.float64), torch.empty(2000)[::2]):
        with pytest.raises(CodecError, match="out must be"):
            codec.decode(codec.encode(x), out=out)


def test_unknown_codec_names_list_the_known_ones() -> None:
    for name in ("int4", "", "INT8", None):
        with pytest.raises(CodecError, match="known: none, fp16, bf16, int8, topk") as info:
            get_codec(name)  # type: ignore[arg-type]
        assert isinstance(info.value, NebulaError)
    with pytest.raises(CodecError, match="unknown codec 'zstd'"):
        decode(Encoded("zstd", 0, {}, b""))
    assert KNOWN_CODECS == ("none", "fp16", "bf16", "int8", "topk")
    with pytest.raises(TypeError):
        CODECS["int4"] = Int8Codec  # type: ignore[index]  # closed registry
    assert all(issubclass(c, Codec) and c.error_bound for c in CODECS.values())
    with pytest.raises(CodecError, match="block_size"):
        get_codec("int8", block_size=0)


# ---------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize(
    ("name", "small"),
    [("int8", 1e-3), ("fp16", 2.0**-12), ("bf16", 2.0**-10)],  # each below half a step at 1.0
)
def test_error_feedback_keeps_the_decoded_sum_on_track(name: str, small: float) -> None:
    codec = get_codec(name)
    x = torch.full((1000,), 1.0 + small)
    x[::256] = 2.0  # for int8: one large value per block makes `small` vanish without EF
    rounds = 200
    ef = ErrorFeedback(codec)
    sum_in = torch.zeros(1000, dtype=torch.float64)
    sum_ef = torch.zeros_like(sum_in)
    sum_plain = torch.zeros_like(sum_in)
    for r in range(rounds):
        xr = x * (1 + 0.01 * (r % 3))
        sum_in += xr.double()
        sum_ef += codec.decode(ef.encode(xr, "theta")).double()
        sum_plain += codec.decode(codec.encode(xr)).double()
    drift_ef = (sum_in - sum_ef).abs().max().item()
    drift_plain = (sum_in - sum_plain).abs().max().item()
    residual = ef.residual("theta")
    assert residual is not None
    one_round = codec.max_abs_error(x * 1.02).max().item()
    assert drift_ef <= one_round * 1.5 + 1e-4  # bounded by one round's error, whatever `rounds`
    assert drift_plain > 20 * drift_ef
    assert torch.allclose((sum_in - sum_ef).float(), residual, atol=1e-4)


def test_error_feedback_random_data_and_bookkeeping() -> None:
    codec = get_codec("int8")
    ef = ErrorFeedback(codec)
    g = torch.Generator().manual_seed(1)
    sum_in = torch.zeros(5000, dtype=torch.float64)
    sum_out = torch.zeros_like(sum_in)
    for _ in range(100):
        xr = torch.randn(5000, generator=g)
        sum_in += xr.double()
        sum_out += codec.decode(ef.encode(xr, "a")).double()
        bound = (xr.abs().max().item() + 0.05) / 254  # |residual| <= absmax(x + residual)/254
        assert ef.residual("a").abs().max().item() <= bound  # type: ignore[union-attr]
    assert (sum_in - sum_out).abs().max() < 0.05
    ef.encode(torch.ones(10), "b")  # keys are independent
    with pytest.raises(CodecError, match="reset"):
        ef.encode(torch.ones(11), "b")
    ef.reset("b")
    assert ef.residual("b") is None and ef.residual("a") is not None
    ef.encode(torch.ones(11), "b")
    ef.reset()
    assert ef.residual("a") is None and ef.residual("b") is None
    assert ef.encode(torch.zeros(0), "empty").numel == 0


# ---------------------------------------------------------------------------- chunks


def test_chunks_are_aligned_views_that_encode_like_the_whole() -> None:
    x = torch.randn(10_000)
    chunks = list(iter_chunks(x, 1000))
    assert [c.numel() for c in chunks] == [768] * 13 + [16]  # 1000 rounded down to 3 blocks
    assert all(
        c.is_contiguous() and c.data_ptr() == x[i * 768 :].data_ptr() for i, c in enumerate(chunks)
    )
    codec = get_codec("int8")
    pieces = [codec.decode(codec.encode(c)) for c in chunks]
    assert torch.equal(torch.cat(pieces), codec.decode(codec.encode(x)))  # block-aligned
    assert chunk_spans(10, 1) == [(0, 10)]  # never smaller than one block
    assert chunk_spans(0, 256) == [] and list(iter_chunks(torch.empty(0), 256)) == []
    assert chunk_spans(600, 300, align=100) == [(0, 300), (300, 600)]
    with pytest.raises(CodecError, match="1-D contiguous"):
        iter_chunks(torch.randn(10, 10)[:, 0], 256)
    for bad in (0, -5, 2.5):
        with pytest.raises(CodecError, match="chunk_numel"):
            iter_chunks(x, bad)  # type: ignore[arg-type]
