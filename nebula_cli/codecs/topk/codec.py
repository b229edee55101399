"""The ``topk`` codec on the wire (relay layer), the sparse one: top-k per span with low-bit
values (SparseLoCo's recipe).

``topk`` cuts the tensor into spans and keeps, in every span, the ``k`` elements of largest
magnitude; a partial last span keeps min(k, its size). The span is the ``span`` knob, a power of
two from 16 to 4096 (k = round(density x span), at least 1; a position in a span of 2**p is p
bits), or from the density: at least 1/32 uses spans of 16 (1 of 16 is 0.0625, 2 of 16 is
0.125), a lower one spans of 256. Each kept value is sent in ``bits`` bits (1, 2, 4 or 8): the
sign, then ``bits - 1`` bits of magnitude on the grid lo + j (hi - lo) / (2**(bits-1) - 1)
between the smallest and the largest kept magnitude of its block (two bfloat16 scales per block
of 1024 elements, or per span when it is longer), nearest point (for 2 bits: lo or hi; a kept
zero makes lo = 0 and decodes exactly). With 1 bit the sign is all: lo is then the mean kept
magnitude of the block (the one level that loses least in L2), what each kept value decodes
to with its sign (a kept zero, in a span of fewer than k non-zeros, counts in the mean and
decodes to +lo; hi is written all the same, one format for every width, and not read).
Everything else decodes as zero: what the codec drops is the relay's error feedback's business
(it carries it into the next round, so nothing is lost, only delayed).

Payload (little-endian): one pair of bfloat16 (lo, hi) per block, then the K positions (span by
span, in the order torch.topk returns them) packed as a stream of p-bit codes, then the K values
as a stream of ``bits``-bit codes, each code's lowest bit first (K = kept elements; p = 4: two
positions a byte). Bits per element: 1 of 16 in 2 bits is 6/16 + 1/32 = 0.41 (79x fewer than
fp32); 2 of 16: 0.78 (41x); 64 of 4096 in 1 bit (SparseLoCo's 1.56 %): 13/64 + 1/128 = 0.21
(152x); 1 of 4096 in 1 bit: 0.011 (2,900x), of which the scales are 0.0078.

The mean of sparse parts is not sparse in the same way (up to n x k non-zeros per span), so
relays never re-encode it: with this codec every relay sends its encoding to every other and
sums the decoded parts itself (relay/allreduce.py), exactly.

Error bound, per element: max(|x|, a (1 / (2**bits - 2) + 2**-7)) x (1 + 2**-12) with a the
block's largest magnitude: a dropped element loses itself (|x| <= a), a kept one half a step of
the grid plus the rounding of the two scales; with 1 bit, a (1 + 2**-7) (1 + 2**-12) (the mean
and the value both lie in [0, a]). Input beyond bfloat16's range (|x| > 3.39e38) is
refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nebula_cli.codecs.topk.params import (
    TOPK_BIT_CHOICES,
    TOPK_SCALE_BLOCK,
    TOPK_SPAN_AUTO,
    TOPK_SPANS,
    TopKParams,
    topk_scale_block,
)
from nebula_cli.codecs.topk.params import topk_position_bits as _pos_bits
from nebula_cli.relay.codecs.base import (
    Codec,
    CodecError,
    Encoded,
    buffer_view,
    check_input,
    is_int,
    prepare,
)

BLOCK = TOPK_SCALE_BLOCK
"""Elements per scale block (one pair of bfloat16 scales), or the span when it is longer."""
SPANS = TOPK_SPANS
"""Elements per top-k span: a position in a span of 2**p takes p bits."""
BITS = TOPK_BIT_CHOICES


def layout_for(density: float) -> tuple[int, int]:
    """(span, kept per span) for a density (`TopKParams.layout`); CodecError unless the
    density is in (0, 1]."""
    if not isinstance(density, int | float) or isinstance(density, bool) or not (
        0.0 < density <= 1.0
    ):
        raise CodecError(f"topk: density must be in (0, 1], got {density!r}")
    return TopKParams(density=density).layout()


class TopKCodec(Codec):
    """Top-k per span; values as sign and ``bits - 1`` magnitude bits between the smallest and
    the largest kept magnitude of each block of 1024 or of each longer span (two bfloat16
    scales)."""

    Params = TopKParams
    error_bound = ("max(|x|, absmax_block * (1 / (2**bits - 2) + 2**-7)) * (1 + 2**-12) "
                   "(dropped: |x|; 1 bit: absmax_block * (1 + 2**-7) * (1 + 2**-12))")

    def __init__(self, density: float = TopKParams.density, bits: int = TopKParams.bits, *,
                 span: int | None = TopKParams.span) -> None:
        layout_for(density)
        if span is not None and not (is_int(span) and span == TOPK_SPAN_AUTO):
            _check_span(span)
        self.span, self.k = TopKParams(density=density,
                                       span=span or TOPK_SPAN_AUTO).layout()
        self.bits = _check_bits(bits)

    @property
    def density(self) -> float:
        return self.k / self.span

    @property
    def limit(self) -> float:
        """Largest magnitude accepted (a block's scale is a bfloat16)."""
        return float(torch.finfo(torch.bfloat16).max)

    # ------------------------------------------------------------------ layout

    def meta(self) -> dict[str, int]:
        return {"span": self.span, "k": self.k, "bits": self.bits}

    def check_meta(self, meta: Mapping[str, Any]) -> None:
        if set(meta) != {"span", "k", "bits"}:
            raise CodecError("topk: meta must be {'span': int, 'k': int, 'bits': int}, got "
                             f"{dict(meta)!r}")
        _check_k(meta["k"], _check_span(meta["span"]))
        _check_bits(meta["bits"])

    def _layout(self, meta: Mapping[str, Any] | None) -> tuple[int, int, int]:
        if meta is None:
            return self.span, self.k, self.bits
        self.check_meta(meta)
        return meta["span"], meta["k"], meta["bits"]

    def payload_nbytes(self, numel: int, meta: Mapping[str, Any] | None = None) -> int:
        span, k, bits = self._layout(meta)
        kept = _kept(numel, span, k)
        return (4 * _blocks(numel, span) + _packed_len(kept, _pos_bits(span))
                + _packed_len(kept, bits))

    # ------------------------------------------------------------------ bounds

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        x = prepare(x)
        block = topk_scale_block(self.span)
        absmax = _block_absmax(x, block)
        half_step = 1.0 if self.bits == 1 else 1 / (2**self.bits - 2)
        per = (absmax * (half_step + 2.0**-7)).repeat_interleave(block)[: x.numel()]
        return torch.maximum(x.abs(), per) * (1 + 2.0**-12)

    # ------------------------------------------------------------------ encode / decode

    def _select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in span as int64, values) of the kept elements, span by span."""
        n, span, k = x.numel(), self.span, self.k
        full = n // span
        pos, val = [], []
        if full:
            xb = x[: full * span].view(full, span)
            mag = xb.abs()  # one of a span: argmax is twice as fast as topk on short rows
            idx = (mag.argmax(dim=1, keepdim=True) if k == 1
                   else mag.topk(k, dim=1, sorted=False).indices)
            pos.append(idx.reshape(-1))
            val.append(xb.gather(1, idx).reshape(-1))
        tail = x[full * span :]
        if tail.numel():
            idx = tail.abs().topk(min(k, tail.numel()), sorted=False).indices
            pos.append(idx)
            val.append(tail[idx])
        if not pos:
            return torch.empty(0, dtype=torch.int64), torch.empty(0)
        return torch.cat(pos), torch.cat(val)

    def _encode(self, x: torch.Tensor) -> Encoded:
        check_input(x, self.name, self.limit)
        n, span, k, bits = x.numel(), self.span, self.k, self.bits
        pos, val = self._select(x)
        block = topk_scale_block(span)
        kept, nb = pos.numel(), _blocks(n, span)
        buf = bytearray(self.payload_nbytes(n))
        if kept:
            first = _kept_first(n, span, k)
            blocks = torch.div(first, block, rounding_mode="floor")
            mag = val.abs()
            ranges = buffer_view(buf, torch.bfloat16, 0, 2 * nb).view(nb, 2)
            lo = (torch.zeros(nb).scatter_reduce_(0, blocks, mag, "mean", include_self=False)
                  if bits == 1 else  # the one level: the mean kept magnitude
                  torch.full((nb,), torch.inf).scatter_reduce_(0, blocks, mag, "amin"))
            ranges[:, 0].copy_(lo)
            ranges[:, 1].copy_(_block_absmax(x, block))
            q = (val < 0).to(torch.uint8) << (bits - 1)  # the sign is the top bit
            if bits > 1:
                lo_b, hi_b = (ranges[blocks, i].float() for i in (0, 1))
                steps = (1 << (bits - 1)) - 1  # magnitude levels lo + j (hi - lo) / steps
                width = hi_b - lo_b
                j = torch.where(width > 0, (mag - lo_b) / torch.where(width > 0, width, 1.0),
                                0.0)
                q |= (j * steps).round_().clamp_(0, steps).to(torch.uint8)
            pos_len = _packed_len(kept, _pos_bits(span))
            buffer_view(buf, torch.uint8, 4 * nb, pos_len).copy_(
                _pack(pos, _pos_bits(span)))
            off = 4 * nb + pos_len
            buffer_view(buf, torch.uint8, off, len(buf) - off).copy_(_pack(q, bits))
        return Encoded(self.name, n, self.meta(), buf)

    def _decode(self, enc: Encoded, out: torch.Tensor) -> None:
        n = enc.numel
        span, k, bits = enc.meta["span"], enc.meta["k"], enc.meta["bits"]
        kept, nb = _kept(n, span, k), _blocks(n, span)
        out.zero_()
        if not kept:
            return
        first = _kept_first(n, span, k)
        blocks = torch.div(first, topk_scale_block(span), rounding_mode="floor")
        ranges = buffer_view(enc.payload, torch.bfloat16, 0, 2 * nb).view(nb, 2).float()
        lo_b, hi_b = ranges[blocks, 0], ranges[blocks, 1]
        pos_len = _packed_len(kept, _pos_bits(span))
        pos = _unpack(buffer_view(enc.payload, torch.uint8, 4 * nb, pos_len),
                      _pos_bits(span), kept).to(torch.int64)
        packed = buffer_view(enc.payload, torch.uint8, 4 * nb + pos_len, _packed_len(kept, bits))
        q = _unpack(packed, bits, kept)
        steps = (1 << (bits - 1)) - 1
        val = (lo_b + (q & steps).float() * ((hi_b - lo_b) / steps) if steps
               else lo_b)  # 1 bit: every kept value is its block's mean magnitude
        val = torch.where((q >> (bits - 1)).bool(), -val, val)
        where = first + pos
        if int(where.max()) >= n:
            raise CodecError(f"topk: a position points past the {n} elements")
        out.index_copy_(0, where, val)


def _blocks(numel: int, span: int) -> int:
    return -(-numel // topk_scale_block(span))


def _packed_len(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block max |x| (the last block may be partial)."""
    n = x.numel()
    pad = -n % block
    a = torch.nn.functional.pad(x.abs(), (0, pad)) if pad else x.abs()
    return a.view(-1, block).amax(1) if n else torch.empty(0)


def _kept(numel: int, span: int, k: int) -> int:
    full, tail = divmod(numel, span)
    return full * k + min(k, tail)


def _kept_first(numel: int, span: int, k: int) -> torch.Tensor:
    """For each kept element (in payload order), the first index of its span."""
    full, tail = divmod(numel, span)
    first = torch.arange(0, full * span, span).repeat_interleave(k)
    if tail:
        first = torch.cat([first, torch.full((min(k, tail),), full * span, dtype=torch.int64)])
    return first


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``bits`` bits (below 2**bits) -> bytes: a stream of the codes, each code's
    lowest bit first (bits dividing 8: 8/bits codes per byte)."""
    if 8 % bits:
        return _pack_stream(q, bits)
    q = q.to(torch.uint8)
    if bits == 8:
        return q
    per = 8 // bits
    pad = -q.numel() % per
    if pad:
        q = torch.cat([q, torch.zeros(pad, dtype=torch.uint8)])
    q = q.view(-1, per)
    out = q[:, 0].clone()
    for j in range(1, per):
        out |= q[:, j] << (bits * j)
    return out


def _pack_stream(q: torch.Tensor, bits: int) -> torch.Tensor:
    """_pack for any width: each code's bits, lowest first, then eight to a byte."""
    stream = ((q.to(torch.int32).unsqueeze(1) >> torch.arange(bits, dtype=torch.int32)) & 1)
    stream = stream.to(torch.uint8).reshape(-1)
    pad = -stream.numel() % 8
    if pad:
        stream = torch.cat([stream, torch.zeros(pad, dtype=torch.uint8)])
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)
    return (stream.view(-1, 8) * weights).sum(1, dtype=torch.int32).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` codes of _pack (uint8 for bits up to 8, else int32)."""
    if 8 % bits:
        stream = (packed.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1
        codes = stream.reshape(-1)[: count * bits].view(count, bits).to(torch.int32)
        return (codes << torch.arange(bits, dtype=torch.int32)).sum(1, dtype=torch.int32)
    if bits == 8:
        return packed.clone()
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    return torch.stack(parts, dim=1).reshape(-1)[:count]


def _check_bits(bits: object) -> int:
    if not is_int(bits) or bits not in BITS:
        raise CodecError(f"topk: bits must be one of {BITS}, got {bits!r}")
    return bits  # type: ignore[return-value]


def _check_span(span: object) -> int:
    if not is_int(span) or span not in SPANS:
        raise CodecError(f"topk: span must be one of {SPANS}, got {span!r}")
    return span  # type: ignore[return-value]


def _check_k(k: object, span: int) -> int:
    if not is_int(k) or not 1 <= k <= span:  # type: ignore[operator]
        raise CodecError(f"topk: k must be an integer in [1, {span}], got {k!r}")
    return k  # type: ignore[return-value]


CODECS = (TopKCodec,)
"""This package's codecs (`nebula_cli/codecs/registry.py`)."""
