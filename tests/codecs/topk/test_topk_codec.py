"""codecs/topk/codec.py: the layout a density means, what is kept (the largest magnitudes of
each span, with their signs), the payload byte by byte, the stated bound, and refusals of
knobs and of encodings the format cannot carry."""

from __future__ import annotations

import pytest
import torch

from nebula_cli.codecs.topk.codec import BITS, BLOCK, SPANS, TopKCodec, layout_for
from nebula_cli.codecs.topk.params import TopKParams
from nebula_cli.relay.codecs.base import CodecError, Encoded


def test_layout_follows_the_params_and_refuses_bad_densities() -> None:
    for density in (1.0, 0.125, 0.0625, 0.03, 0.001):
        assert layout_for(density) == TopKParams(density=density).layout()
    for bad in (0, -0.1, 1.01, "0.1", True, None):
        with pytest.raises(CodecError, match="density must be in"):
            layout_for(bad)  # type: ignore[arg-type]
    assert BLOCK == 1024 and BITS == (1, 2, 4, 8)
    assert tuple(2 ** p for p in range(4, 13)) == SPANS


def test_constructor_knobs_and_meta() -> None:
    codec = TopKCodec()
    assert (codec.name, codec.sparse, codec.density, codec.bits) == ("topk", True, 0.0625, 2)
    assert codec.meta() == {"span": 16, "k": 1, "bits": 2}
    assert TopKCodec(0.0625, 4, span=256).meta() == {"span": 256, "k": 16, "bits": 4}
    assert TopKCodec.from_params(TopKParams(density=0.5, bits=8)).meta() == {
        "span": 16, "k": 8, "bits": 8}
    assert TopKCodec(1 / 64, 1, span=4096).meta() == {"span": 4096, "k": 64, "bits": 1}
    assert TopKCodec.from_params(TopKParams(density=0.01, span=32)).meta() == {
        "span": 32, "k": 1, "bits": 2}
    with pytest.raises(CodecError, match="bits must be one of"):
        TopKCodec(0.0625, 3)
    for span in (8, 48, 8192, True):
        with pytest.raises(CodecError, match="span must be one of"):
            TopKCodec(0.0625, 2, span=span)


def test_keeps_the_largest_magnitude_of_each_span_with_its_sign() -> None:
    x = torch.zeros(40)
    x[3], x[20], x[21], x[35] = 0.5, -2.0, 1.0, 0.25  # spans [0,16) [16,32) [32,40)
    codec = TopKCodec(0.0625, 8)
    y = codec.decode(codec.encode(x))
    assert torch.nonzero(y).flatten().tolist() == [3, 20, 35]
    assert y[20] == -2.0 and y[3] > 0 and y[35] > 0
    # one block: scales lo = 0.25 (smallest kept magnitude), hi = 2.0 (largest), exact
    assert y[35] == 0.25
    assert bool(((y - x).abs() <= codec.max_abs_error(x)).all())


def test_payload_byte_by_byte() -> None:
    n = 2 * BLOCK + 40  # 3 scale blocks; 130 full spans of 16 and a partial one of 8
    codec = TopKCodec(0.125, 4)  # 2 of 16 kept, 4-bit positions, 4-bit values
    kept = (n // 16) * 2 + min(2, n % 16)
    assert codec.payload_nbytes(n) == 3 * 4 + -(-kept * 4 // 8) + -(-kept * 4 // 8)
    enc = codec.encode(torch.randn(n))
    assert enc.nbytes == codec.payload_nbytes(n) and enc.meta == codec.meta()
    assert TopKCodec().payload_nbytes(0) == 0


def test_encodings_the_format_cannot_carry_are_refused() -> None:
    codec = TopKCodec()
    enc = codec.encode(torch.randn(64))
    for meta, why in (({"span": 16, "k": 1}, "meta must be"),
                      ({"span": 48, "k": 1, "bits": 2}, "span must be"),
                      ({"span": 8192, "k": 1, "bits": 2}, "span must be"),
                      ({"span": 16, "k": 17, "bits": 2}, "k must be an integer in"),
                      ({"span": 16, "k": 1, "bits": 5}, "bits must be one of")):
        with pytest.raises(CodecError, match=why):
            codec.decode(Encoded("topk", 64, meta, enc.payload))
    # a 4-bit position of 15 in the partial last span of 8 points past the tensor
    short = codec.encode(torch.arange(1.0, 25.0))  # spans [0,16) and [16,24)
    payload = bytearray(short.payload)
    payload[4] = 0xFF  # both positions (low and high nibble) -> 15
    with pytest.raises(CodecError, match="points past the 24 elements"):
        codec.decode(Encoded("topk", 24, short.meta, payload))


def test_input_beyond_bfloat16_is_refused() -> None:
    with pytest.raises(CodecError, match="beyond the codec's range"):
        TopKCodec().encode(torch.tensor([3.4e38, 1.0]))


@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("bits", BITS)
def test_every_span_and_width_round_trips_within_its_bound(span: int, bits: int) -> None:
    """Spans of 16 to 4096 (positions of 4 to 12 bits, packed as a stream where 8 is no
    multiple of the width), values of 1 to 8 bits: each span keeps its k largest, the payload
    is as long as stated, every element within the stated bound, and the last partial span
    and scale block are handled."""
    g = torch.Generator().manual_seed(span * 10 + bits)
    n = 3 * max(span, BLOCK) + 37
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g)
    codec = TopKCodec(4 / span, bits, span=span)
    enc = codec.encode(x)
    assert enc.nbytes == codec.payload_nbytes(n) == len(enc.payload)
    y = codec.decode(enc)
    assert bool(((y - x).abs() <= codec.max_abs_error(x)).all())
    full = n // span
    kept = torch.nonzero(y[: full * span].view(full, span)).shape[0]
    assert kept == full * codec.k  # every kept value is non-zero here (no kept zeros)
    top = x[: full * span].view(full, span).abs().topk(codec.k, dim=1).indices.sort(1).values
    got = torch.nonzero(y[: full * span].view(full, span))[:, 1].view(full, codec.k)
    assert torch.equal(got, top)
    assert torch.equal(torch.sign(y[y != 0]), torch.sign(x[y != 0]))


def test_one_bit_sends_the_sign_and_the_blocks_mean_kept_magnitude() -> None:
    """1 bit: every kept value decodes to its block's mean kept magnitude with its own sign
    (the level that loses least in L2 to one number); SparseLoCo's 64 of 4096 costs 13 bits a
    kept value and one pair of scales a span."""
    x = torch.zeros(2 * 4096)
    x[[5, 70, 300]] = torch.tensor([1.0, -3.0, 2.0])  # the first span keeps these three
    x[4096 + 9] = -0.5
    codec = TopKCodec(3 / 4096, 1, span=4096)
    y = codec.decode(codec.encode(x))
    assert y[[5, 70, 300]].tolist() == [2.0, -2.0, 2.0]  # the mean of 1, 3, 2 with each sign
    # the second span keeps -0.5 and two zeros (the first two positions, topk's order aside):
    # they share the mean 0.5 / 3, the zeros with a plus sign, within the bound
    assert y[4096 + 9].item() == pytest.approx(-0.5 / 3, rel=1e-2)
    second = torch.nonzero(y[4096:]).flatten().tolist()
    assert len(second) == 3 and 9 in second
    assert bool(((y - x).abs() <= codec.max_abs_error(x)).all())
    assert codec.payload_nbytes(8192) == 2 * 4 + -(-6 * 12 // 8) + -(-6 // 8)
    sparse = TopKCodec(1 / 64, 1, span=4096)
    assert sparse.payload_nbytes(4096 * 100) == 100 * (4 + 64 * 13 // 8)


def test_the_stream_packing_is_the_byte_packing_where_both_apply() -> None:
    """Widths that divide 8 keep their layout (payloads of the 16 and 256 spans unchanged);
    the stream writes each code's lowest bit first, as they do."""
    from nebula_cli.codecs.topk import codec as topk
    for bits in (1, 2, 4, 8):
        codes = torch.randint(0, 1 << bits, (37,), generator=torch.Generator().manual_seed(3))
        assert torch.equal(topk._pack_stream(codes, bits), topk._pack(codes, bits))
        assert torch.equal(topk._unpack(topk._pack(codes, bits), bits, 37).long(), codes)
    codes = torch.randint(0, 16, (37,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(topk._unpack(topk._pack(codes, 4), 4, 37).long(), codes)
    wide = torch.randint(0, 4096, (101,), generator=torch.Generator().manual_seed(4))
    assert topk._pack(wide, 12).numel() == -(-101 * 12 // 8)
    assert torch.equal(topk._unpack(topk._pack(wide, 12), 12, 101).long(), wide)
    assert topk._pack(torch.tensor([0xABC]), 12).tolist() == [0xBC, 0x0A]


@pytest.mark.parametrize(("span", "bits", "density", "digest"), [
    (16, 2, 0.0625, "db1fb6826e9a6df9"), (16, 4, 0.0625, "44f8b77e4ee172c4"),
    (16, 8, 0.0625, "2e8d164504740935"), (16, 2, 0.125, "da042a29de71971c"),
    (256, 2, 0.02, "eaed8296ab28b913"), (256, 4, 0.02, "3f87082cef747399"),
    (256, 8, 0.02, "933f3c4fe0b88b94"), (256, 2, 0.0625, "50cef8b08e11616f")])
def test_the_earlier_layouts_payloads_are_byte_for_byte_what_they_were(
        span: int, bits: int, density: float, digest: str) -> None:
    """Spans of 16 and 256 in 2, 4 and 8 bits: the payloads of commit 325e743 (before spans up
    to 4096 and 1-bit values), pinned by their sha256 (kept zeros included). A torch whose topk
    returned a span's picks in another order would show here too."""
    import hashlib
    g = torch.Generator().manual_seed(42)
    x = torch.randn(5000, generator=g)
    x[::7] = 0.0
    payload = bytes(TopKCodec(density, bits, span=span).encode(x).payload)
    assert hashlib.sha256(payload).hexdigest()[:16] == digest


def test_span_false_is_refused_not_taken_for_auto() -> None:
    with pytest.raises(CodecError, match="span must be one of"):
        TopKCodec(0.0625, 2, span=False)  # type: ignore[arg-type]
