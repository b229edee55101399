"""relay/codecs/chunks.py: spans cover a tensor exactly, in whole blocks of the alignment (by
default the int8 codec's default block), and bad sizes are refused before anything is cut."""

from __future__ import annotations

import pytest
import torch

from nebula_cli.codecs.int8.params import Int8Params
from nebula_cli.relay.codecs.base import CodecError
from nebula_cli.relay.codecs.chunks import DEFAULT_ALIGN, chunk_spans, iter_chunks


@pytest.mark.parametrize(("numel", "chunk", "align"), [
    (1, 1, 1), (1000, 256, 256), (1025, 300, 256), (10_000, 1 << 20, 64), (4097, 1000, 7)])
def test_spans_cover_the_tensor_in_whole_blocks(numel: int, chunk: int, align: int) -> None:
    spans = chunk_spans(numel, chunk, align=align)
    assert spans[0][0] == 0 and spans[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert all((hi - lo) % align == 0 and hi - lo >= align for lo, hi in spans[:-1])
    x = torch.arange(float(numel))
    assert torch.equal(torch.cat(list(iter_chunks(x, chunk, align=align))), x)


def test_the_default_alignment_is_the_int8_block_and_bad_sizes_are_refused() -> None:
    assert DEFAULT_ALIGN == Int8Params().block_size == 256
    assert chunk_spans(1000, 600) == [(0, 512), (512, 1000)]
    for numel in (-1, 2.0, True):
        with pytest.raises(CodecError, match="numel must be a non-negative integer"):
            chunk_spans(numel, 256)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="align must be a positive integer"):
        chunk_spans(10, 256, align=0)
