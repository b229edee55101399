"""The codecs of the WAN hop by name: the closed registry (:data:`CODECS`) and the ways to get
a codec from it. A flat fp32 tensor to a compact payload and back (hivemind style).

Five codecs, each named on the wire and each described, for the plan, by its params class in
:mod:`nebula_cli.config.codec_params` (its knobs, its cost, what the handshake compares):

========  =====================================  ===============================================
name      payload (little-endian)                error bound, per element
========  =====================================  ===============================================
none      numel float32                          exact
fp16      numel float16                          max(|x| * 2**-11, 2**-25); |x| <= 65504
bf16      numel bfloat16                         max(|x| * 2**-8, 2**-134); |x| <= 3.39e38
int8      ceil(numel/B) float32 scales, then     absmax_block/254 * (1 + 2**-12); a block whose
          numel int8 values                      absmax is below 2**-110 is sent as zeros
topk      scales, positions, packed values       max(|x|, absmax_group/(2**bits-1)) (1 + 2**-12)
========  =====================================  ===============================================

(Each is its package's ``codec`` module, `nebula_cli/codecs/<package>/codec.py`: ``none``,
``half`` (fp16, bf16), ``int8``, ``topk``, registered in `nebula_cli/codecs/registry.py`.)
Encoding refuses (CodecError) input that is not finite or is beyond the codec's
range: the relay never forwards poison. Decoding checks the codec name, numel, meta and the
exact payload length before touching the payload; it does not check the decoded values unless
asked (``check_finite=True``), because the relay decides itself what to do with a non-finite
part.

The registry is checked at import against the plan's catalog (``CODEC_PARAMS``): the same
names in the same order, each class built on its own params class.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from nebula_cli.codecs import registry as packages
from nebula_cli.config.codec_params import CODEC_PARAMS, CodecParams, params_from_knobs
from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.relay.codecs.base import Codec, CodecError, Encoded


def _build_registry(*classes: type[Codec]) -> Mapping[str, type[Codec]]:
    registry: dict[str, type[Codec]] = {}
    for cls in classes:
        if cls.name in registry:
            raise RuntimeError(f"codec name {cls.name!r} registered twice")
        if CODEC_PARAMS.get(cls.name) is not cls.Params:
            raise RuntimeError(f"codec {cls.name!r} ({cls.__name__}) has no params class in "
                               f"nebula_cli.config.codec_params.CODEC_PARAMS (its package's "
                               f"params.PARAMS)")
        registry[cls.name] = cls
    if tuple(registry) != tuple(CODEC_PARAMS):
        raise RuntimeError(f"codecs {tuple(registry)} registered, the plan's catalog has "
                           f"{tuple(CODEC_PARAMS)}: register each codec in both "
                           f"(its package's params.PARAMS and codec.CODECS), in one order")
    return MappingProxyType(registry)


CODECS: Mapping[str, type[Codec]] = _build_registry(
    *(cls for module in packages.parts("codec") for cls in module.CODECS))
"""The closed registry: wire name -> codec class."""
KNOWN_CODECS: tuple[str, ...] = tuple(CODECS)


def _class_of(name: str) -> type[Codec]:
    cls = CODECS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CodecError(f"unknown codec {name!r} (known: {', '.join(KNOWN_CODECS)})")
    return cls


def codec_for(params: CodecParams) -> Codec:
    """The codec these params describe, with their knob values."""
    return _class_of(params.name).from_params(params)


def get_codec(name: str, **knobs: Any) -> Codec:
    """The codec called name, with the knobs given by name (any codec's: ``block_size`` is
    int8's, ``density`` and ``bits`` are topk's; the others take their defaults). CodecError
    for unknown names, listing the known ones."""
    cls = _class_of(name)
    return cls.from_params(params_from_knobs(knobs)[cls.name])


def codecs_of(names: list[str] | tuple[str, ...], **knobs: Any) -> dict[str, Codec]:
    """name -> codec for each of ``names`` (a relay's candidates with ``compression: auto``,
    else its one codec), in order, with the knobs given by name."""
    params = params_from_knobs(knobs)
    return {n: _class_of(n).from_params(params[n]) for n in names}


def relay_codecs(cfg: RelayConfig) -> dict[str, Codec]:
    """The codecs a relay's rounds may use: ``compression: auto``'s candidates, else its one,
    each with the plan's params."""
    names = cfg.auto_codec.codecs if cfg.auto_codec else [cfg.codec]
    for name in names:
        _class_of(name)
    return {n: codec_for(cfg.codec_params[n]) for n in names}


def decode(
    enc: Encoded, *, out: torch.Tensor | None = None, check_finite: bool = False
) -> torch.Tensor:
    """Decode with the codec enc names (block size, k and bits come from enc.meta)."""
    if not isinstance(enc, Encoded):
        raise CodecError(f"expected an Encoded, got {type(enc).__name__}")
    return get_codec(enc.codec).decode(enc, out=out, check_finite=check_finite)
