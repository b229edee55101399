"""Codecs for the WAN hop: a flat fp32 tensor to a compact payload and back (hivemind style).

A closed registry of five codecs, each named on the wire (``topk``, the sparse one, is described
in :mod:`nebula_cli.relay.codecs.topk`):

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

int8 is blockwise absmax quantisation: for every block of B (``block_size``, default 256)
elements, scale = absmax/127 and q = round(x/scale) in [-127, 127]; the last block may be
partial; an all-zero block has scale 0 and decodes to zeros.

Encoding refuses (CodecError) input that is not finite or is beyond the codec's range: the relay
never forwards poison. Decoding checks the codec name, numel, meta and the exact payload length
before touching the payload; it does not check the decoded values unless asked
(``check_finite=True``), because the relay decides itself what to do with a non-finite part.
Everything is vectorised torch on the CPU; no Python loop runs over elements.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.relay.codecs.base import (
    Codec,
    CodecError,
    Encoded,
    all_finite,
    buffer_view,
    check_input,
    is_int,
    prepare,
)
from nebula_cli.relay.codecs.topk import DEFAULT_BITS, DEFAULT_DENSITY, TopKCodec

DEFAULT_BLOCK_SIZE = 256
MAX_BLOCK_SIZE = 1 << 20
INT8_FLUSH_BELOW = 2.0**-110
"""int8 blocks whose absmax is below this are sent as zeros (their scale would underflow)."""
_WORK_ELEMS = 1 << 18  # int8 encode works in pieces of this many elements (temp stays in cache)



class NoneCodec(Codec):
    """fp32 as is: 4 bytes per element, exact."""

    name = "none"
    error_bound = "exact"

    def payload_nbytes(self, numel: int, meta: Mapping[str, Any] | None = None) -> int:
        self.check_meta(meta or {})
        return 4 * numel

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(prepare(x))

    def _encode(self, x: torch.Tensor) -> Encoded:
        check_input(x, self.name, math.inf)
        buf = bytearray(4 * x.numel())
        buffer_view(buf, torch.float32, 0, x.numel()).copy_(x)
        return Encoded(self.name, x.numel(), {}, buf)

    def _decode(self, enc: Encoded, out: torch.Tensor) -> None:
        out.copy_(buffer_view(enc.payload, torch.float32, 0, enc.numel))


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

    name = "fp16"
    error_bound = "max(|x| * 2**-11, 2**-25); input limited to |x| <= 65504"
    wire_dtype = torch.float16
    rel = 2.0**-11
    tiny = 2.0**-25


class Bf16Codec(_CastCodec):
    """bfloat16: fp32's exponent range, 8 significant bits."""

    name = "bf16"
    error_bound = "max(|x| * 2**-8, 2**-134); input limited to |x| <= 3.3895e38"
    wire_dtype = torch.bfloat16
    rel = 2.0**-8
    tiny = 2.0**-134


class Int8Codec(Codec):
    """Blockwise absmax int8: one fp32 scale per block_size elements, then one int8 each."""

    name = "int8"
    error_bound = (
        "absmax_block/254 * (1 + 2**-12) (half a quantisation step, plus float rounding); "
        "a block with absmax < 2**-110 is sent as zeros (error <= absmax there)"
    )

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
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


def _build_registry(*classes: type[Codec]) -> Mapping[str, type[Codec]]:
    registry: dict[str, type[Codec]] = {}
    for cls in classes:
        if cls.name in registry:
            raise RuntimeError(f"codec name {cls.name!r} registered twice")
        registry[cls.name] = cls
    return MappingProxyType(registry)


CODECS: Mapping[str, type[Codec]] = _build_registry(
    NoneCodec, Fp16Codec, Bf16Codec, Int8Codec, TopKCodec
)
"""The closed registry: wire name -> codec class."""
KNOWN_CODECS: tuple[str, ...] = tuple(CODECS)


def get_codec(name: str, *, block_size: int = DEFAULT_BLOCK_SIZE,
              density: float = DEFAULT_DENSITY, bits: int = DEFAULT_BITS) -> Codec:
    """The codec called name (block_size is int8's; density and bits are topk's). CodecError
    for unknown names, listing the known ones."""
    cls = CODECS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CodecError(f"unknown codec {name!r} (known: {', '.join(KNOWN_CODECS)})")
    if cls is Int8Codec:
        return Int8Codec(block_size)
    if cls is TopKCodec:
        return TopKCodec(density, bits)
    return cls()


def codecs_of(names: list[str] | tuple[str, ...], *, block_size: int = DEFAULT_BLOCK_SIZE,
              density: float = DEFAULT_DENSITY, bits: int = DEFAULT_BITS) -> dict[str, Codec]:
    """name -> codec for each of ``names`` (a relay's candidates with ``compression: auto``,
    else its one codec), in order."""
    return {n: get_codec(n, block_size=block_size, density=density, bits=bits) for n in names}


def relay_codecs(cfg: RelayConfig) -> dict[str, Codec]:
    """The codecs a relay's rounds may use: ``compression: auto``'s candidates, else its one."""
    return codecs_of(cfg.auto_codec.codecs if cfg.auto_codec else [cfg.codec],
                     block_size=cfg.block_size, density=cfg.density, bits=cfg.bits)


def decode(
    enc: Encoded, *, out: torch.Tensor | None = None, check_finite: bool = False
) -> torch.Tensor:
    """Decode with the codec enc names (block size, k and bits come from enc.meta)."""
    if not isinstance(enc, Encoded):
        raise CodecError(f"expected an Encoded, got {type(enc).__name__}")
    return get_codec(enc.codec).decode(enc, out=out, check_finite=check_finite)


class ErrorFeedback:
    """Error feedback around a codec: what rounding lost for a key in one round is added to that
    key's next input, so the sum of decoded values tracks the sum of inputs (their difference is
    the current residual, bounded by one round's codec error)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def encode(self, x: torch.Tensor, key: Hashable, codec: Codec | None = None) -> Encoded:
        """Encode x + residual[key] (with ``codec``, default the one given at construction);
        keep residual[key] := (x + residual) - decode(encoding). The residual is a dense fp32
        tensor whatever the codec, so a round may change codecs (``compression: auto``): what
        one codec left out goes into the next codec's input. On a CodecError the residual is
        left as it was."""
        codec = codec or self.codec
        x = prepare(x)
        residual = self._residuals.get(key)
        if residual is not None and residual.numel() != x.numel():
            raise CodecError(
                f"error feedback for {key!r}: got {x.numel()} elements, the kept residual has "
                f"{residual.numel()} (reset() it when the layout changes)"
            )
        target = x if residual is None else x + residual
        enc = codec.encode(target)
        self._residuals[key] = target - codec.decode(enc)
        return enc

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The residual kept for key (None if there is none)."""
        return self._residuals.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of key, or of every key when key is None."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)


def chunk_spans(
    numel: int, chunk_numel: int, *, align: int = DEFAULT_BLOCK_SIZE
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
    x: torch.Tensor, chunk_numel: int, *, align: int = DEFAULT_BLOCK_SIZE
) -> Iterator[torch.Tensor]:
    """Contiguous views of a flat contiguous tensor, chunk by chunk (see chunk_spans), so a large
    tensor can be encoded, sent and decoded piece by piece. An empty tensor yields nothing."""
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.is_contiguous():
        raise CodecError("iter_chunks needs a 1-D contiguous tensor")
    spans = chunk_spans(x.numel(), chunk_numel, align=align)  # checked now, not on first next()
    return (x[lo:hi] for lo, hi in spans)
