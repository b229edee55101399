"""The 16-bit float codecs on the wire (relay layer): each element cast to IEEE half (``fp16``)
or bfloat16 (``bf16``); see :mod:`nebula_cli.relay.codecs.registry` for every codec's payload
and error bound side by side."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from nebula_cli.codecs.half.params import Bf16Params, Fp16Params
from nebula_cli.relay.codecs.base import (
    Codec,
    Encoded,
    buffer_view,
    check_input,
    prepare,
)


class _CastCodec(Codec):
    """A 16-bit float cast: 2 bytes per element, round to nearest even."""

    wire_dtype: ClassVar[torch.dtype]
    rel: ClassVar[float]
    tiny: ClassVar[float]

    def payload_nbytes(self, numel: int, meta: Mapping[str, Any] | None = None) -> int:
        self.check_meta(meta or {})
        return 2 * numel

    @property
    def limit(self) -> float:
        """Largest magnitude accepted (the format's largest finite value)."""
        return float(torch.finfo(self.wire_dtype).max)

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        return (prepare(x).abs() * self.rel).clamp_min_(self.tiny)

    def _encode(self, x: torch.Tensor) -> Encoded:
        check_input(x, self.name, self.limit)
        buf = bytearray(2 * x.numel())
        buffer_view(buf, self.wire_dtype, 0, x.numel()).copy_(x)
        return Encoded(self.name, x.numel(), {}, buf)

    def _decode(self, enc: Encoded, out: torch.Tensor) -> None:
        out.copy_(buffer_view(enc.payload, self.wire_dtype, 0, enc.numel))


class Fp16Codec(_CastCodec):
    """IEEE half: 11 significant bits; refuses |x| > 65504."""

    Params = Fp16Params
    error_bound = "max(|x| * 2**-11, 2**-25); input limited to |x| <= 65504"
    wire_dtype = torch.float16
    rel = 2.0**-11
    tiny = 2.0**-25


class Bf16Codec(_CastCodec):
    """bfloat16: fp32's exponent range, 8 significant bits."""

    Params = Bf16Params
    error_bound = "max(|x| * 2**-8, 2**-134); input limited to |x| <= 3.3895e38"
    wire_dtype = torch.bfloat16
    rel = 2.0**-8
    tiny = 2.0**-134


CODECS = (Fp16Codec, Bf16Codec)
"""This package's codecs, in the spec's order (`nebula_cli/codecs/registry.py`)."""
