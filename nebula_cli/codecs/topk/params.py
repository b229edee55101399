"""The ``topk`` codec as the plan knows it: top-k per span with low-bit values, its density and
bits, its layout and cost (config layer, standard library only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nebula_cli.config.codec_knobs import CodecParams, knob

TOPK_BIT_CHOICES = (1, 2, 4, 8)
"""Bits a topk value may take on the wire (1: its sign only)."""
TOPK_SCALE_BLOCK = 1024
"""topk: elements per pair of bfloat16 scales, at least (a span longer than this has its own)."""
TOPK_SPANS = tuple(2 ** p for p in range(4, 13))
"""topk: elements per top-k span, the powers of two from 16 to 4096 (SparseLoCo's chunk); a
position in a span of 2**p takes p bits."""
TOPK_SPAN_AUTO = 0
"""The ``span`` knob's "from the density": spans of 16 from a density of 1/32 up, else 256."""


@dataclass(frozen=True)
class TopKParams(CodecParams):
    """Top-k per span with low-bit values (`nebula_cli.codecs.topk.codec`). Its error
    feedback carries the past rounds, so its rounds take no outer momentum, and what stays
    unsent fades by 0.7 a round (as SparseLoCo's outer step: the residual a momentum of what
    was not sent). Measured with bench/diloco_schedule.py on 2026-12-07 (docs/benchmarks.md,
    "Error feedback as momentum"): the median eval-loss gap to flat data parallel over five
    seeds at 30 rounds fell from 3.15 % (no decay) to -1.09 % (worst seed -0.18 %; 0.9: 0.04 %,
    0.8: -1.55 %), over three seeds at 5 rounds from 6.64 % to 1.63 % (0.8: 2.86 %); at 2
    rounds it rose from 19.4 % to 21.9 % (topk is not for runs that short: what it leaves out
    of a round is never sent)."""

    name: ClassVar[str] = "topk"
    sparse: ClassVar[bool] = True
    auto: ClassVar[bool] = True
    rel_error: ClassVar[float] = 1.0  # a dropped element loses itself
    outer_lr: ClassVar[float] = 2.5
    outer_momentum: ClassVar[float] = 0.0
    feedback_decay: ClassVar[float] = 0.7

    density: float = knob(0.0625, gt=0.0, le=1.0)
    """Fraction of the elements sent each round (1 of every 16; per span, at least one)."""
    bits: int = knob(2, choices=TOPK_BIT_CHOICES)
    """Bits per sent value (1: its sign, the magnitude the mean of its block's kept ones)."""
    span: int = knob(TOPK_SPAN_AUTO, choices=(TOPK_SPAN_AUTO, *TOPK_SPANS))
    """Elements per top-k span, a power of two from 16 to 4096 (0: from the density, 16 or
    256). Longer spans choose among more elements per position bit: SparseLoCo keeps 64 of
    4096."""

    def layout(self) -> tuple[int, int]:
        """(span, kept per span): the span asked, keeping round(density x span), at least one;
        or from the density: spans of 16 (4-bit positions) once it keeps at least one of 16,
        else spans of 256 (8-bit positions), at least one kept."""
        if self.span != TOPK_SPAN_AUTO:
            return self.span, max(1, min(self.span, round(self.density * self.span)))
        if round(self.density * 16) >= 1:
            return 16, min(16, round(self.density * 16))
        return 256, max(1, round(self.density * 256))

    def bytes_per_element(self) -> float:
        span, k = self.layout()
        return (4.0 / topk_scale_block(span)
                + k / span * (topk_position_bits(span) + self.bits) / 8)

    def label(self) -> str:
        span = "" if self.span == TOPK_SPAN_AUTO else f", span {self.span}"
        return f"topk (density {self.density:g}, {self.bits} bit{'s' * (self.bits > 1)}{span})"


def topk_position_bits(span: int) -> int:
    """Bits of a kept element's position in its span (a power of two)."""
    return span.bit_length() - 1


def topk_scale_block(span: int) -> int:
    """Elements per pair of scales: TOPK_SCALE_BLOCK, or the span when it is longer."""
    return max(TOPK_SCALE_BLOCK, span)


PARAMS = (TopKParams,)
"""This package's codecs' params (`nebula_cli/codecs/registry.py`)."""
