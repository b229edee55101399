"""relay/codecs/registry.py: the closed registry matches the plan's catalog, codecs are built
from their params (knobs routed by name), every registered codec round-trips (dtypes, empty
tensors, through a frame's meta), and each costs on the wire what its params say."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from helpers.plan_defaults import relay_defaults

from nebula_cli.codecs.half.codec import Fp16Codec
from nebula_cli.codecs.int8.codec import Int8Codec
from nebula_cli.codecs.none.codec import NoneCodec
from nebula_cli.codecs.none.params import NoneParams
from nebula_cli.codecs.topk.codec import TopKCodec
from nebula_cli.codecs.topk.params import TopKParams
from nebula_cli.config.codec_params import CODEC_PARAMS, params_from_knobs
from nebula_cli.config.relay_config import AutoCodec, RelayConfig
from nebula_cli.relay.codecs import registry
from nebula_cli.relay.codecs.base import Codec, CodecError, Encoded
from nebula_cli.relay.codecs.registry import (
    CODECS,
    KNOWN_CODECS,
    codec_for,
    codecs_of,
    decode,
    get_codec,
    relay_codecs,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SIZES = [0, 1, 17, 1023, 1025, 4097]
VARIANTS = [  # knob values besides the defaults, each codec's own
    {}, {"block_size": 16}, {"block_size": 1000}, {"density": 0.125, "bits": 4},
    {"density": 0.02, "bits": 8}, {"density": 1.0, "bits": 2}]


def test_the_registry_is_the_catalog_in_the_same_order() -> None:
    assert KNOWN_CODECS == tuple(CODEC_PARAMS) == ("none", "fp16", "bf16", "int8", "topk")
    for name, cls in CODECS.items():
        assert issubclass(cls, Codec) and cls.error_bound
        assert cls.Params is CODEC_PARAMS[name]
        assert (cls.name, cls.sparse) == (cls.Params.name, cls.Params.sparse)
    assert [n for n, c in CODECS.items() if c.sparse] == ["topk"]
    with pytest.raises(TypeError):
        CODECS["int4"] = Int8Codec  # type: ignore[index]  # closed


def test_the_registry_refuses_what_the_catalog_does_not_know() -> None:
    @dataclass(frozen=True)
    class StrayParams(NoneParams):
        name: ClassVar[str] = "stray"

    class Stray(NoneCodec):
        Params = StrayParams

    with pytest.raises(RuntimeError, match="registered twice"):
        registry._build_registry(NoneCodec, NoneCodec)
    with pytest.raises(RuntimeError, match="'stray' .* has no params class"):
        registry._build_registry(Stray)
    with pytest.raises(RuntimeError, match="register each codec in both"):
        registry._build_registry(NoneCodec, Fp16Codec)


def test_knobs_are_routed_to_their_codec() -> None:
    topk = get_codec("topk", density=0.125, bits=4, block_size=64)
    assert isinstance(topk, TopKCodec) and (topk.span, topk.k, topk.bits) == (16, 2, 4)
    int8 = get_codec("int8", block_size=64, density=0.5)
    assert isinstance(int8, Int8Codec) and int8.block_size == 64
    default = get_codec("topk")
    assert isinstance(default, TopKCodec) and (default.density, default.bits) == (0.0625, 2)
    with pytest.raises(TypeError, match="unknown codec knob"):
        get_codec("int8", levels=3)
    with pytest.raises(CodecError, match="int8: block_size must be an integer in"):
        get_codec("int8", block_size=0)  # the wire format's limit, not the spec's
    with pytest.raises(CodecError, match="unknown codec 'int4' .known: none, fp16, bf16"):
        get_codec("int4")
    both = codecs_of(["int8", "topk"], block_size=128, bits=8)
    assert list(both) == ["int8", "topk"]
    assert both["int8"].payload_nbytes(256) == 2 * 4 + 256
    assert both["topk"].meta() == {"span": 16, "k": 1, "bits": 8}  # type: ignore[attr-defined]


def test_codec_for_params_and_a_relays_codecs() -> None:
    assert codec_for(TopKParams(density=0.25)).meta() == {  # type: ignore[attr-defined]
        "span": 16, "k": 4, "bits": 2}
    with pytest.raises(CodecError, match="expected Int8Params"):
        Int8Codec.from_params(TopKParams())

    def config(**settings: Any) -> RelayConfig:
        return RelayConfig(job_id="j", cluster="a", clusters=["a"], peer_listen="127.0.0.1:1",
                           worker_listen="127.0.0.1:2", peers={},
                           tls={"ca": "/ca", "cert": "/c", "key": "/k"},
                           **relay_defaults(**settings))

    one = relay_codecs(config(codec="int8", block_size=32))
    assert list(one) == ["int8"] and one["int8"].payload_nbytes(64) == 2 * 4 + 64
    auto = AutoCodec(codecs=["int8", "topk"], target_utilization=0.9, overlap=False,
                     budget_steps=10, budget_s=None)
    both = relay_codecs(config(codec="auto", auto_codec=auto, density=0.125))
    assert list(both) == ["int8", "topk"]
    assert both["topk"].meta() == {"span": 16, "k": 2, "bits": 2}  # type: ignore[attr-defined]
    with pytest.raises(CodecError, match="unknown codec 'zstd'"):
        relay_codecs(config(codec="zstd"))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", KNOWN_CODECS)
def test_every_registered_codec_round_trips(name: str, dtype: torch.dtype, size: int) -> None:
    codec = get_codec(name)
    g = torch.Generator().manual_seed(size)
    x = (torch.randn(size, generator=g) * 0.01).to(dtype).reshape(-1, 1)  # not flat: flattened
    enc = codec.encode(x)
    assert (enc.codec, enc.numel, enc.nbytes) == (name, size, codec.payload_nbytes(size))
    y = codec.decode(enc)
    assert y.dtype == torch.float32 and y.shape == (size,)
    err = (y.double() - x.reshape(-1).float().double()).abs()
    assert bool((err <= codec.max_abs_error(x).double()).all())
    again = Encoded.from_wire(enc.wire_meta(), bytes(enc.payload))  # read-only, via the meta
    assert torch.equal(decode(again), y)
    if size == 0:
        assert enc.nbytes == 0 and y.numel() == 0


@pytest.mark.parametrize("knobs", VARIANTS, ids=str)
@pytest.mark.parametrize("name", KNOWN_CODECS)
def test_a_codec_costs_what_its_params_say(name: str, knobs: dict[str, Any]) -> None:
    """The advisor's price (bytes_per_element, standard library) is the payload's size per
    element of a large tensor (every span, block and scale group whole)."""
    params = params_from_knobs(knobs)[name]
    codec = codec_for(params)
    numel = 1024 * 1000 * 16
    assert codec.payload_nbytes(numel) / numel == pytest.approx(params.bytes_per_element(),
                                                                rel=1e-12)
    x = torch.randn(numel // 1000, generator=torch.Generator().manual_seed(0))
    assert codec.encode(x).nbytes == codec.payload_nbytes(x.numel())
