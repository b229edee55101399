"""A flat tensor cut into chunks that are encoded, sent and decoded one by one (pipelined):
every chunk but the last is a whole number of int8 blocks, so chunking does not change an int8
encoding whatever the codec of the round."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nebula_cli.codecs.int8.params import Int8Params
from nebula_cli.relay.codecs.base import CodecError, is_int

DEFAULT_ALIGN = Int8Params.block_size
"""Chunks align to the int8 codec's default block unless told otherwise."""


def chunk_spans(
    numel: int, chunk_numel: int, *, align: int = DEFAULT_ALIGN
) -> list[tuple[int, int]]:
    """[(start, stop), ...] covering range(numel) in chunks of chunk_numel rounded down to a
    multiple of align (at least align), so every chunk but the last is whole int8 blocks."""
    if not is_int(numel) or numel < 0:
        raise CodecError(f"numel must be a non-negative integer, got {numel!r}")
    for label, v in (("chunk_numel", chunk_numel), ("align", align)):
        if not is_int(v) or v < 1:
            raise CodecError(f"{label} must be a positive integer, got {v!r}")
    step = max(align, chunk_numel - chunk_numel % align)
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]


def iter_chunks(
    x: torch.Tensor, chunk_numel: int, *, align: int = DEFAULT_ALIGN
) -> Iterator[torch.Tensor]:
    """Contiguous views of a flat contiguous tensor, chunk by chunk (see chunk_spans), so a large
    tensor can be encoded, sent and decoded piece by piece. An empty tensor yields nothing."""
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.is_contiguous():
        raise CodecError("iter_chunks needs a 1-D contiguous tensor")
    spans = chunk_spans(x.numel(), chunk_numel, align=align)  # checked now, not on first next()
    return (x[lo:hi] for lo, hi in spans)
