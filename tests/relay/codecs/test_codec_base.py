"""relay/codecs/base.py: the encoded form and its frame meta, input preparation and checks,
zero-copy payload views, and what a codec class takes from its params class."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from nebula_cli.codecs.none.codec import NoneCodec
from nebula_cli.codecs.none.params import NoneParams
from nebula_cli.errors import NebulaError
from nebula_cli.relay.codecs.base import (
    Codec,
    CodecError,
    Encoded,
    all_finite,
    buffer_view,
    check_input,
    extremes,
    is_int,
    prepare,
)


def test_encoded_travels_in_a_frames_meta() -> None:
    enc = Encoded("int8", 3, {"block_size": 256}, bytearray(b"abc"))
    meta = {**enc.wire_meta(), "round": 4}
    assert meta == {"codec": "int8", "numel": 3, "codec_meta": {"block_size": 256}, "round": 4}
    again = Encoded.from_wire(meta, b"abc")
    assert again == Encoded("int8", 3, {"block_size": 256}, b"abc") and again.nbytes == 3
    for bad, why in (({"codec": 1, "numel": 3}, "'codec' must be a string"),
                     ({"codec": "int8", "numel": -1}, "'numel' must be a non-negative"),
                     ({"codec": "int8", "numel": True}, "'numel' must be a non-negative"),
                     ({"codec": "int8", "numel": 3, "codec_meta": []}, "must be an object")):
        with pytest.raises(CodecError, match=why) as info:
            Encoded.from_wire(bad, b"")
        assert isinstance(info.value, NebulaError)


def test_prepare_flattens_to_fp32_on_the_cpu() -> None:
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    y = prepare(x)
    assert y.dtype == torch.float32 and y.shape == (6,) and y.is_contiguous()
    assert y.tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(CodecError, match="floating-point"):
        prepare(torch.arange(3))
    with pytest.raises(CodecError, match="expected a torch.Tensor"):
        prepare([1.0, 2.0])


def test_finiteness_and_range_checks() -> None:
    assert extremes(torch.tensor([3.0, -5.0, 1.0])) == (-5.0, 3.0)
    assert all_finite(torch.empty(0)) and all_finite(torch.tensor([3e38, 3e38]))  # sum overflows
    assert not all_finite(torch.tensor([1.0, math.nan]))
    assert not all_finite(torch.tensor([math.inf, -math.inf]))
    check_input(torch.empty(0), "x", 1.0)
    check_input(torch.tensor([-1.0, 1.0]), "x", 1.0)
    with pytest.raises(CodecError, match="magnitude 2, beyond the codec's range"):
        check_input(torch.tensor([-2.0, 1.0]), "x", 1.0)
    with pytest.raises(CodecError, match="NaN or infinite"):
        check_input(torch.tensor([0.0, math.inf]), "x", math.inf)
    assert is_int(3) and not is_int(True) and not is_int(3.0)


def test_buffer_views_share_memory_and_read_only_payloads_are_read() -> None:
    buf = bytearray(12)
    view = buffer_view(buf, torch.float32, 4, 2)
    view.fill_(1.5)
    assert buffer_view(bytes(buf), torch.float32, 0, 3).tolist() == [0.0, 1.5, 1.5]
    assert buffer_view(b"", torch.int8, 0, 0).numel() == 0
    with pytest.raises(CodecError, match="contiguous"):
        buffer_view(memoryview(bytearray(8))[::2], torch.int8, 0, 4)


def test_a_codec_class_takes_its_name_and_sparsity_from_its_params() -> None:
    @dataclass(frozen=True)
    class ShoutParams(NoneParams):
        name: ClassVar[str] = "shout"
        sparse: ClassVar[bool] = True

    class Shout(NoneCodec):
        Params = ShoutParams

    assert (Shout.name, Shout.sparse) == ("shout", True)
    assert (NoneCodec.name, NoneCodec.sparse) == ("none", False)  # the parent is untouched
    assert isinstance(Shout.from_params(ShoutParams()), Shout)
    with pytest.raises(CodecError, match="expected ShoutParams"):
        Shout.from_params(NoneParams())
    with pytest.raises(TypeError):
        Codec()  # type: ignore[abstract]


def test_decode_checks_the_encoding_before_the_payload() -> None:
    codec = NoneCodec()
    enc = codec.encode(torch.ones(4))
    for bad, why in ((Encoded("fp16", 4, {}, enc.payload), "encoded with 'fp16', not 'none'"),
                     (Encoded("none", 5, {}, enc.payload), "payload of 16 bytes, expected 20"),
                     (Encoded("none", 4, {"x": 1}, enc.payload), "unexpected meta"),
                     (Encoded("none", 4, {}, 5), "not bytes-like")):  # type: ignore[arg-type]
        with pytest.raises(CodecError, match=why):
            codec.decode(bad)
    with pytest.raises(CodecError, match="expected an Encoded"):
        codec.decode(b"")  # type: ignore[arg-type]
