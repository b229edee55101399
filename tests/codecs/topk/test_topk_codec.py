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
    assert (BLOCK, SPANS, BITS) == (1024, (16, 256), (2, 4, 8))


def test_constructor_knobs_and_meta() -> None:
    codec = TopKCodec()
    assert (codec.name, codec.sparse, codec.density, codec.bits) == ("topk", True, 0.0625, 2)
    assert codec.meta() == {"span": 16, "k": 1, "bits": 2}
    assert TopKCodec(0.0625, 4, span=256).meta() == {"span": 256, "k": 16, "bits": 4}
    assert TopKCodec.from_params(TopKParams(density=0.5, bits=8)).meta() == {
        "span": 16, "k": 8, "bits": 8}
    with pytest.raises(CodecError, match="bits must be one of"):
        TopKCodec(0.0625, 3)
    with pytest.raises(CodecError, match="span must be one of"):
        TopKCodec(0.0625, 2, span=32)


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
                      ({"span": 32, "k": 1, "bits": 2}, "span must be"),
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
