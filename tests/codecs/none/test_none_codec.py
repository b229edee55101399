"""codecs/none/codec.py: fp32 as is, sent and received as views (no copy), the only codec that
has them; a view refuses what `decode` would."""

from __future__ import annotations

import pytest
import torch

from nebula_cli.codecs.int8.codec import Int8Codec
from nebula_cli.codecs.none.codec import NoneCodec
from nebula_cli.relay.codecs.base import CodecError, Encoded
from nebula_cli.relay.codecs.contribution import decode


def test_a_chunk_is_sent_and_received_as_a_view() -> None:
    x = torch.arange(6, dtype=torch.float32)
    enc = NoneCodec().encode_view(x)
    assert (enc.codec, enc.numel, enc.meta) == ("none", 6, {})
    x[0] = 7.0  # the payload is the chunk's memory
    got = decode(NoneCodec(), enc)
    assert got.tolist() == [7.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    x[1] = 9.0  # and so is what was decoded
    assert got[1].item() == 9.0
    assert decode(NoneCodec(), Encoded("none", 0, {}, b"")).numel() == 0


def test_other_codecs_and_odd_encodings_are_decoded_not_viewed() -> None:
    x = torch.linspace(-1, 1, 300)
    assert Int8Codec().encode_view(x) is None
    enc = Int8Codec().encode(x)
    assert Int8Codec().decode_view(enc) is None
    assert torch.allclose(decode(Int8Codec(), enc), x, atol=2 / 254)
    assert NoneCodec().decode_view(enc) is None
    with pytest.raises(CodecError, match="payload was encoded with 'int8'"):
        decode(NoneCodec(), enc)
    with pytest.raises(CodecError, match="none: payload of 8 bytes for 3 elements"):
        decode(NoneCodec(), Encoded("none", 3, {}, bytes(8)))
