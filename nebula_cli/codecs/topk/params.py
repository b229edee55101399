"""The ``topk`` codec as the plan knows it: top-k per span with low-bit values, its density and
bits, its layout and cost (config layer, standard library only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nebula_cli.config.codec_knobs import CodecParams, knob

TOPK_BIT_CHOICES = (2, 4, 8)
"""Bits a topk value may take on the wire."""
TOPK_SCALE_BLOCK = 1024
"""topk: elements per pair of bfloat16 scales."""
TOPK_SPANS = (16, 256)
"""topk: elements per top-k span (both divide TOPK_SCALE_BLOCK); a position takes 4 or 8 bits."""


@dataclass(frozen=True)
class TopKParams(CodecParams):
    """Top-k per span with low-bit values (`nebula_cli.codecs.topk.codec`). Its error
    feedback carries the past rounds, so its rounds take no outer momentum (as SparseLoCo)."""

    name: ClassVar[str] = "topk"
    sparse: ClassVar[bool] = True
    auto: ClassVar[bool] = True
    rel_error: ClassVar[float] = 1.0  # a dropped element loses itself
    outer_lr: ClassVar[float] = 2.5
    outer_momentum: ClassVar[float] = 0.0

    density: float = knob(0.0625, gt=0.0, le=1.0)
    """Fraction of the elements sent each round (1 of every 16; per span, at least one)."""
    bits: int = knob(2, choices=TOPK_BIT_CHOICES)
    """Bits per sent value."""

    def layout(self) -> tuple[int, int]:
        """(span, kept per span) of this density: spans of 16 (4-bit positions) once it keeps
        at least one of 16, else spans of 256 (8-bit positions), at least one kept."""
        if round(self.density * 16) >= 1:
            return 16, min(16, round(self.density * 16))
        return 256, max(1, round(self.density * 256))

    def bytes_per_element(self) -> float:
        span, k = self.layout()
        return 4.0 / TOPK_SCALE_BLOCK + k / span * (topk_position_bits(span) + self.bits) / 8

    def label(self) -> str:
        return f"topk (density {self.density:g}, {self.bits} bits)"


def topk_position_bits(span: int) -> int:
    """Bits of a kept element's position in its span."""
    return 4 if span == TOPK_SPANS[0] else 8


PARAMS = (TopKParams,)
"""This package's codecs' params (`nebula_cli/codecs/registry.py`)."""
