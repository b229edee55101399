"""The ``int8`` codec on the wire (relay layer): every element as int8 with a scale per block;
see :mod:`nebula_cli.relay.codecs.registry` for every codec's payload and error bound side by
side.

int8 is blockwise absmax quantisation: for every block of B (``block_size``, default 256)
elements, scale = absmax/127 and q = round(x/scale) in [-127, 127]; the last block may be
partial; an all-zero block has scale 0 and decodes to zeros. A block whose absmax is below
2**-110 is sent as zeros (its scale would underflow).

Everything is vectorised torch on the CPU; no Python loop runs over elements.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nebula_cli.codecs.int8.params import Int8Params
from nebula_cli.relay.codecs.base import (
    Codec,
    CodecError,
    Encoded,
    all_finite,
    buffer_view,
    is_int,
    prepare,
)

MAX_BLOCK_SIZE = 1 << 20
"""The largest int8 block the wire format accepts."""
INT8_FLUSH_BELOW = 2.0**-110
"""int8 blocks whose absmax is below this are sent as zeros (their scale would underflow)."""
_WORK_ELEMS = 1 << 18  # int8 encode works in pieces of this many elements (temp stays in cache)


class Int8Codec(Codec):
    """Blockwise absmax int8: one fp32 scale per block_size elements, then one int8 each."""

    Params = Int8Params
    error_bound = (
        "absmax_block/254 * (1 + 2**-12) (half a quantisation step, plus float rounding); "
        "a block with absmax < 2**-110 is sent as zeros (error <= absmax there)"
    )

    def __init__(self, block_size: int = Int8Params.block_size) -> None:
        self.block_size = _check_block_size(block_size)

    def check_meta(self, meta: Mapping[str, Any]) -> None:
        if set(meta) != {"block_size"}:
            raise CodecError(f"int8: meta must be {{'block_size': int}}, got {dict(meta)!r}")
        _check_block_size(meta["block_size"])

    def payload_nbytes(self, numel: int, meta: Mapping[str, Any] | None = None) -> int:
        if meta is None:
            bs = self.block_size
        else:
            self.check_meta(meta)
            bs = meta["block_size"]
        return 4 * -(-numel // bs) + numel

    def _absmax(self, x: torch.Tensor, bs: int) -> torch.Tensor:
        """Per-block max |x| (NaN propagates); the last block may be partial."""
        n, full = x.numel(), x.numel() // bs
        out = torch.empty(-(-n // bs), dtype=torch.float32)
        if full:
            xb = x[: full * bs].view(full, bs)
            torch.maximum(xb.amax(1), xb.amin(1).neg_(), out=out[:full])
        if n > full * bs:
            tail = x[full * bs :]
            out[full] = torch.maximum(tail.amax(), tail.amin().neg())
        return out

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        x = prepare(x)
        absmax = self._absmax(x, self.block_size)
        live = absmax >= INT8_FLUSH_BELOW
        bound = torch.where(live, absmax * ((1 + 2.0**-12) / 254), absmax)
        return bound.repeat_interleave(self.block_size)[: x.numel()]

    def _encode(self, x: torch.Tensor) -> Encoded:
        n, bs = x.numel(), self.block_size
        nb = -(-n // bs)
        absmax = self._absmax(x, bs)
        if n and not all_finite(absmax):
            raise CodecError("int8: input contains NaN or infinite values; refusing to encode")
        live = absmax >= INT8_FLUSH_BELOW
        buf = bytearray(4 * nb + n)
        scales = buffer_view(buf, torch.float32, 0, nb)
        q = buffer_view(buf, torch.int8, 4 * nb, n)
        torch.div(absmax, 127.0, out=scales)
        scales.mul_(live)
        overflow = torch.isinf(scales * 127.0)  # absmax near fp32 max: 127*scale rounded up
        if bool(overflow.any()):
            scales.copy_(torch.where(overflow, torch.nextafter(scales, torch.zeros(())), scales))
        inv = torch.where(live, 127.0 / absmax, 0.0).unsqueeze(1)
        full = n // bs
        step = max(1, _WORK_ELEMS // bs)  # blocks per piece
        tmp = torch.empty(min(full, step), bs)
        for b0 in range(0, full, step):
            b1 = min(full, b0 + step)
            _quantize(
                x[b0 * bs : b1 * bs].view(-1, bs), inv[b0:b1], q[b0 * bs : b1 * bs], tmp[: b1 - b0]
            )
        if n > full * bs:
            tail = x[full * bs :].view(1, -1)
            _quantize(tail, inv[full:], q[full * bs :], torch.empty_like(tail))
        return Encoded(self.name, n, {"block_size": bs}, buf)

    def _decode(self, enc: Encoded, out: torch.Tensor) -> None:
        n, bs = enc.numel, enc.meta["block_size"]
        nb, full = -(-n // bs), n // bs
        scales = buffer_view(enc.payload, torch.float32, 0, nb)
        out.copy_(buffer_view(enc.payload, torch.int8, 4 * nb, n))
        if full:
            out[: full * bs].view(full, bs).mul_(scales[:full].unsqueeze(1))
        if n > full * bs:
            out[full * bs :].mul_(scales[full])


def _quantize(xb: torch.Tensor, inv: torch.Tensor, q: torch.Tensor, tmp: torch.Tensor) -> None:
    """q (flat int8 view) := clamp(round(xb * inv), -127, 127); tmp is scratch shaped like xb."""
    torch.mul(xb, inv, out=tmp)
    tmp.round_().clamp_(-127.0, 127.0)
    q.view(tmp.shape).copy_(tmp)


def _check_block_size(bs: object) -> int:
    if not is_int(bs) or not 1 <= bs <= MAX_BLOCK_SIZE:  # type: ignore[operator]
        raise CodecError(
            f"int8: block_size must be an integer in [1, {MAX_BLOCK_SIZE}], got {bs!r}"
        )
    return bs  # type: ignore[return-value]


CODECS = (Int8Codec,)
"""This package's codecs (`nebula_cli/codecs/registry.py`)."""
