"""What every WAN codec shares: the encoded form (:class:`Encoded`), the interface
(:class:`Codec`), its error (:class:`CodecError`) and the helpers codecs build on (input checks,
zero-copy views of a payload). The codecs themselves are their packages' ``codec`` modules
(`nebula_cli/codecs/<name>/codec.py`), registered by name in
:mod:`nebula_cli.relay.codecs.registry`; what the plan knows of each (its knobs, its cost, its
name) is its params class, its package's ``params`` module, which the codec class names as
``Params``."""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from nebula_cli.config.codec_params import CodecParams
from nebula_cli.errors import NebulaError

Buffer = bytes | bytearray | memoryview


class CodecError(NebulaError):
    """A tensor a codec cannot encode, or an encoding that does not decode. Says why."""


@dataclass(frozen=True)
class Encoded:
    """One encoded tensor: which codec, how many elements, the codec's own meta (JSON-able,
    e.g. ``{"block_size": 256}``) and the payload. Encoders return a bytearray payload (built in
    place, no copy); decoders accept any bytes-like payload."""

    codec: str
    numel: int
    meta: dict[str, Any] = field(default_factory=dict)
    payload: Buffer = b""

    @property
    def nbytes(self) -> int:
        return memoryview(self.payload).nbytes

    def wire_meta(self) -> dict[str, Any]:
        """The header to put in a frame's meta (merge it with the relay's own keys)."""
        return {"codec": self.codec, "numel": self.numel, "codec_meta": dict(self.meta)}

    @classmethod
    def from_wire(cls, meta: Mapping[str, Any], payload: Buffer) -> Encoded:
        """Rebuild from a frame's meta (other keys ignored) and payload; types are checked."""
        codec, numel, cmeta = meta.get("codec"), meta.get("numel"), meta.get("codec_meta", {})
        if not isinstance(codec, str):
            raise CodecError(f"frame meta: 'codec' must be a string, got {codec!r}")
        if not is_int(numel) or numel < 0:
            raise CodecError(f"frame meta: 'numel' must be a non-negative integer, got {numel!r}")
        if not isinstance(cmeta, dict):
            raise CodecError(f"frame meta: 'codec_meta' must be an object, got {cmeta!r}")
        return cls(codec, numel, dict(cmeta), payload)


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def prepare(x: object) -> torch.Tensor:
    """Any floating tensor -> flat, contiguous, float32, CPU (bf16/fp16/fp64 are converted)."""
    if not isinstance(x, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise CodecError(f"expected a floating-point tensor, got {x.dtype}")
    return x.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()


def extremes(x: torch.Tensor) -> tuple[float, float]:
    """(min, max) of a non-empty tensor in one pass; NaN propagates into both (as aminmax
    does)."""
    lo, hi = torch.aminmax(x)
    return float(lo), float(hi)


def all_finite(x: torch.Tensor) -> bool:
    """True when no element is NaN or infinite: a finite sum says so in one fast pass (NaN and
    inf propagate into it), else (an overflow, or a non-finite value) the exact extremes."""
    if x.numel() == 0 or math.isfinite(float(x.sum())):
        return True
    lo, hi = extremes(x)
    return math.isfinite(lo) and math.isfinite(hi)


def check_input(x: torch.Tensor, codec: str, limit: float) -> None:
    if x.numel() == 0:
        return
    lo, hi = extremes(x)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise CodecError(f"{codec}: input contains NaN or infinite values; refusing to encode")
    peak = max(-lo, hi)
    if peak > limit:
        raise CodecError(
            f"{codec}: input has a value of magnitude {peak:.6g}, beyond the codec's range "
            f"(|x| <= {limit:.6g}); use codec 'bf16', 'int8' or 'none'"
        )


def buffer_view(buf: Buffer, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """A tensor over count elements of buf starting at byte offset (no copy)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if sys.byteorder != "little":
        raise CodecError("codec payloads are little-endian; big-endian hosts are not supported")
    view = memoryview(buf)
    if not view.c_contiguous:
        raise CodecError("payload must be a contiguous buffer")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if not view.readonly:
        return torch.frombuffer(view, dtype=dtype, count=count, offset=offset)
    with warnings.catch_warnings():  # read-only buffers are only ever read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=dtype, count=count, offset=offset)


class Codec(ABC):
    """Turns a flat fp32 tensor into an Encoded and back. A codec class names its params class
    (``Params``: its name on the wire, its knobs, its cost; ``name`` and ``sparse`` are taken
    from it), states its error bound (``error_bound``, and ``max_abs_error(x)``) and says how
    long a valid payload is (``payload_nbytes``). Its constructor takes its knobs by name (what
    :meth:`from_params` passes) and checks what its wire format can carry."""

    Params: ClassVar[type[CodecParams]]
    name: ClassVar[str]
    error_bound: ClassVar[str]
    sparse: ClassVar[bool] = False
    """Encodings keep some coordinates only: averages are summed by every relay, never
    re-encoded (see relay/protocol/allreduce.py)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        params = cls.__dict__.get("Params")
        if params is not None:
            cls.name, cls.sparse = params.name, params.sparse

    @classmethod
    def from_params(cls, params: CodecParams) -> Codec:
        """The codec with these knob values (CodecError if its wire format cannot carry them)."""
        if not isinstance(params, cls.Params):
            raise CodecError(f"{cls.name}: expected {cls.Params.__name__}, got {params!r}")
        return cls(**{f.name: getattr(params, f.name) for f in dataclasses.fields(params)})

    def encode_view(self, x: torch.Tensor) -> Encoded | None:
        """An encoding of a flat fp32 chunk that is a view of it (no copy, no error feedback:
        the codec is exact), where the format allows; None (the default): encode it."""
        return None

    def decode_view(self, enc: Encoded) -> torch.Tensor | None:
        """enc decoded as a view of its payload (no copy), where the format allows; None (the
        default): decode it."""
        return None

    def encode(self, x: torch.Tensor) -> Encoded:
        """Encode a floating tensor (flattened; converted to fp32 first). CodecError for
        non-finite or out-of-range input."""
        return self._encode(prepare(x))

    def decode(
        self, enc: Encoded, *, out: torch.Tensor | None = None, check_finite: bool = False
    ) -> torch.Tensor:
        """A flat fp32 tensor of enc.numel elements (new, or written into ``out``: a 1-D
        contiguous fp32 CPU tensor of that size, e.g. a slice of the round's result). Validates
        everything about enc before reading the payload; with check_finite, also refuses
        non-finite decoded values."""
        if not isinstance(enc, Encoded):
            raise CodecError(f"expected an Encoded, got {type(enc).__name__}")
        if enc.codec != self.name:
            raise CodecError(f"payload was encoded with {enc.codec!r}, not {self.name!r}")
        if not is_int(enc.numel) or enc.numel < 0:
            raise CodecError(
                f"{self.name}: numel must be a non-negative integer, got {enc.numel!r}"
            )
        if not isinstance(enc.meta, Mapping):
            raise CodecError(f"{self.name}: meta must be a mapping, got {enc.meta!r}")
        expected = self.payload_nbytes(enc.numel, enc.meta)
        try:
            got = memoryview(enc.payload).nbytes
        except TypeError:
            raise CodecError(f"{self.name}: payload is not bytes-like") from None
        if got != expected:
            raise CodecError(
                f"{self.name}: payload of {got} bytes, expected {expected} for {enc.numel} "
                f"elements with meta {enc.meta}"
            )
        if out is None:
            out = torch.empty(enc.numel, dtype=torch.float32)
        elif not (
            isinstance(out, torch.Tensor)
            and out.dtype == torch.float32
            and out.device.type == "cpu"
            and out.dim() == 1
            and out.numel() == enc.numel
            and out.is_contiguous()
        ):
            raise CodecError(
                f"{self.name}: out must be a contiguous 1-D fp32 CPU tensor of {enc.numel} elements"
            )
        self._decode(enc, out)
        if check_finite and not all_finite(out):
            raise CodecError(f"{self.name}: payload decodes to non-finite values")
        return out

    def check_meta(self, meta: Mapping[str, Any]) -> None:
        """Raise CodecError unless meta is exactly what this codec writes (default: empty)."""
        if meta:
            raise CodecError(f"{self.name}: unexpected meta {dict(meta)!r}")

    @abstractmethod
    def payload_nbytes(self, numel: int, meta: Mapping[str, Any] | None = None) -> int:
        """Exact payload length for numel elements (meta: the Encoded's, checked; None = own)."""

    @abstractmethod
    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound on |decode(encode(x)) - x| (flat fp32, same numel as x)."""

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> Encoded: ...

    @abstractmethod
    def _decode(self, enc: Encoded, out: torch.Tensor) -> None:
        """Write the decoded values of a validated enc into out."""
