"""The 16-bit float codecs (``fp16``, ``bf16``) as the plan knows them (config layer, standard
library only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nebula_cli.config.codec_knobs import CodecParams


@dataclass(frozen=True)
class Fp16Params(CodecParams):
    """IEEE half: 11 significant bits."""

    name: ClassVar[str] = "fp16"
    rel_error: ClassVar[float] = 2.0**-11

    def bytes_per_element(self) -> float:
        return 2.0


@dataclass(frozen=True)
class Bf16Params(CodecParams):
    """bfloat16: 8 significant bits."""

    name: ClassVar[str] = "bf16"
    rel_error: ClassVar[float] = 2.0**-8

    def bytes_per_element(self) -> float:
        return 2.0


PARAMS = (Fp16Params, Bf16Params)
"""This package's codecs' params, in the spec's order (`nebula_cli/codecs/registry.py`)."""
