"""Each WAN codec as the plan knows it, without torch: its knobs, its cost on the wire, how
faithful it is, what two relays must agree on, and its outer-step defaults.

A codec is described by one frozen dataclass, a subclass of :class:`CodecParams`: its class
attributes say what the codec is (``name`` on the wire, ``sparse``, ``rel_error``, the outer
lr and momentum a round with it takes when the spec names none), its fields are its knobs (each
made by :func:`knob`: the default, defined here once, and the values the spec accepts), and its
methods derive what the plan needs from the knobs' values (``bytes_per_element``, ``label``,
``handshake``). :data:`CODEC_PARAMS` is the closed catalog by name, checked at import.

Who uses it: the spec (`sections.CompressionSpec` has one field per knob, flat as users write
it: ``compression: {codec: topk, density: 0.125}``), the plan (`RelayConfig.codec_params`
carries every codec's params to the relay, whole), the relay (its codec classes,
`nebula_cli.relay.codecs`, are built from their params, and the HELLO compares
``handshake()``), and the planner's advisor (``bytes_per_element``, ``rel_error``). It lives in
``config`` because ``config`` may not import the relay (the layering test), and imports only
the standard library because host processes load the plan.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from nebula_cli.config import strict

AUTO_CODEC = "auto"
"""The spec's ``compression: auto``: the relays choose each round's codec among AUTO_CODECS."""
AUTO_CODECS = ("int8", "topk")
"""The codecs ``compression: auto`` chooses from, the most faithful first (the first rounds')."""
DENSE_OUTER = (0.6, 0.5)
"""The outer lr and Nesterov momentum of a round of a dense codec: a codec's unless it says
otherwise. 0.6 / 0.5 loses at most 3 % of eval loss against flat data parallel with int8 at 2,
5 and 20 rounds (bench/diloco_schedule.py, three seeds); DiLoCo's 0.7 / 0.9, chosen for runs of
hundreds of rounds, lost 4.8-8.3 % at 2 and 5 rounds (docs/benchmarks.md, "A default safe at
every length")."""
TOPK_BIT_CHOICES = (2, 4, 8)
"""Bits a topk value may take on the wire."""
TOPK_SCALE_BLOCK = 1024
"""topk: elements per pair of bfloat16 scales."""
TOPK_SPANS = (16, 256)
"""topk: elements per top-k span (both divide TOPK_SCALE_BLOCK); a position takes 4 or 8 bits."""

_LIMITS = {"gt": (">", float.__gt__), "ge": (">=", float.__ge__),
           "lt": ("<", float.__lt__), "le": ("<=", float.__le__)}


def knob(default: Any, *, choices: tuple[Any, ...] | None = None, only_this_codec: bool = True,
         **limits: float) -> Any:
    """A codec knob (a field of a `CodecParams`): its default and what the spec accepts, as
    ``choices`` or as bounds (``gt``, ``ge``, ``lt``, ``le``). ``only_this_codec=False``: the
    spec also accepts it with another codec (the knob means something to the relay beyond its
    codec)."""
    unknown = set(limits) - set(_LIMITS)
    if unknown:
        raise TypeError(f"knob: unknown limit(s) {sorted(unknown)}")
    return field(default=default, metadata={"choices": choices, "limits": limits,
                                            "only_this_codec": only_this_codec})


@dataclass(frozen=True)
class CodecParams(ABC):
    """One codec and the values of its knobs (none for most). Values are checked where they
    enter: the spec by pydantic from the knobs' declarations, a loaded plan by `problems`; the
    relay's codec classes check what their wire format can carry."""

    name: ClassVar[str]
    """The codec's name in the spec and on the wire."""
    sparse: ClassVar[bool] = False
    """Encodings keep some coordinates only: every relay sends its encoding to every other and
    sums the parts itself (never re-encoded), so a round moves (n - 1) encodings per relay."""
    rel_error: ClassVar[float]
    """Bound on |decode(encode(x)) - x| relative to the largest magnitude near x (its own, or
    its block's): what orders codecs from the most faithful (the advisor's ranking)."""
    outer_lr: ClassVar[float] = DENSE_OUTER[0]
    """Outer learning rate of a round with this codec when the spec names none."""
    outer_momentum: ClassVar[float] = DENSE_OUTER[1]
    """Outer momentum of a round with this codec when the spec names none."""

    @abstractmethod
    def bytes_per_element(self) -> float:
        """Payload bytes per element of a large tensor (what the advisor prices a round by)."""

    def label(self) -> str:
        """How the codec is named to people, its knobs included."""
        return self.name

    def handshake(self) -> dict[str, Any]:
        """What two relays must agree on (their HELLOs carry it; flat, by knob name): every
        knob."""
        return dataclasses.asdict(self)

    @classmethod
    def knobs(cls) -> tuple[dataclasses.Field[Any], ...]:
        return dataclasses.fields(cls)

    @classmethod
    def knob_types(cls) -> dict[str, Any]:
        """Knob name -> its declared type (int, float or bool)."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in cls.knobs()}

    def problems(self) -> list[tuple[str, str]]:
        """(knob, why) for every value the spec would refuse, worded as the spec words it."""
        found = []
        types = self.knob_types()
        for f in self.knobs():
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices is not None:
                if _is_bool(value) or value not in choices:
                    found.append((f.name, f"expected one of {', '.join(map(str, choices))}, "
                                          f"found {_describe(value)}"))
                continue
            kind = types[f.name]
            if not _has_type(value, kind):
                found.append((f.name, f"expected {_NOUNS[kind]}, found {_describe(value)}"))
                continue
            for op, bound in f.metadata["limits"].items():
                sign, holds = _LIMITS[op]
                if not holds(float(value), float(bound)):
                    found.append((f.name, f"expected {_NOUNS[kind]} {sign} {bound:g}, found "
                                          f"{_describe(value)}"))
                    break
        return found


# ---- the codecs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NoneParams(CodecParams):
    """fp32 as is: exact."""

    name: ClassVar[str] = "none"
    rel_error: ClassVar[float] = 0.0

    def bytes_per_element(self) -> float:
        return 4.0


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


@dataclass(frozen=True)
class Int8Params(CodecParams):
    """Blockwise absmax int8: one float32 scale per block, then one byte per element."""

    name: ClassVar[str] = "int8"
    rel_error: ClassVar[float] = 1 / 254  # half a step of the block's absmax / 127

    block_size: int = knob(256, ge=16, only_this_codec=False)
    """Values per scale. The relays also cut every tensor into chunks of whole blocks whatever
    the codec (so that ``compression: auto`` switches codecs on the same chunk boundaries):
    the spec accepts it with any codec."""

    def bytes_per_element(self) -> float:
        return 1.0 + 4.0 / self.block_size


@dataclass(frozen=True)
class TopKParams(CodecParams):
    """Top-k per span with low-bit values (`nebula_cli.relay.codecs.topk`). Its error
    feedback carries the past rounds, so its rounds take no outer momentum (as SparseLoCo)."""

    name: ClassVar[str] = "topk"
    sparse: ClassVar[bool] = True
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


def _catalog(*classes: type[CodecParams]) -> Mapping[str, type[CodecParams]]:
    """The closed catalog: names unique, knob names unique across codecs (the spec is flat)."""
    catalog: dict[str, type[CodecParams]] = {}
    owner: dict[str, str] = {}
    for cls in classes:
        if cls.name in catalog or cls.name == AUTO_CODEC:
            raise RuntimeError(f"codec name {cls.name!r} registered twice (or reserved)")
        for f in cls.knobs():
            if f.name in owner or f.name in ("codec", "error_feedback"):
                raise RuntimeError(f"knob {f.name!r} of {cls.name} is taken")
            owner[f.name] = cls.name
        catalog[cls.name] = cls
    if not set(AUTO_CODECS) <= set(catalog):
        raise RuntimeError(f"compression: auto chooses among {AUTO_CODECS}: not all registered")
    return MappingProxyType(catalog)


CODEC_PARAMS: Mapping[str, type[CodecParams]] = _catalog(
    NoneParams, Fp16Params, Bf16Params, Int8Params, TopKParams)
"""Every codec by name, in the spec's order; a new codec is a class above and a name here (and
its implementation, registered in `nebula_cli.relay.codecs.registry`)."""


def knob_owner() -> dict[str, type[CodecParams]]:
    """Knob name -> the codec params class that declares it, for every knob."""
    return {f.name: cls for cls in CODEC_PARAMS.values() for f in cls.knobs()}


def params_from_knobs(knobs: Mapping[str, Any]) -> CodecParamSet:
    """Every codec's params from flat knob values (the spec's form; knobs not given take
    their defaults). TypeError for a name that is no codec's knob. Values are not checked."""
    owners = knob_owner()
    unknown = sorted(set(knobs) - set(owners))
    if unknown:
        raise TypeError(f"unknown codec knob(s) {', '.join(unknown)}; known: "
                        f"{', '.join(owners)}")
    return CodecParamSet({name: cls(**{f.name: knobs[f.name] for f in cls.knobs()
                                       if f.name in knobs})
                          for name, cls in CODEC_PARAMS.items()})


class CodecParamSet(dict[str, CodecParams]):
    """Every codec's params, by name: the plan's codec settings (`RelayConfig.codec_params`).
    In the plan file, ``{name: {knob: value}}`` with every codec and every knob."""

    @classmethod
    def from_plan(cls, data: Any, where: str) -> CodecParamSet:
        """Strictly, as every part of the plan: every codec once, every knob of its type, then
        each codec's own checks (`CodecParams.problems`); PlanFileError naming the field."""
        if not isinstance(data, Mapping):
            raise strict.PlanFileError(f"{where}: expected a mapping, found {data!r}")
        unknown = sorted(set(data) - set(CODEC_PARAMS))
        missing = [n for n in CODEC_PARAMS if n not in data]
        if unknown or missing:
            raise strict.PlanFileError(
                f"{where}: expected the params of every codec ({', '.join(CODEC_PARAMS)}); "
                + "; ".join(part for part in (unknown and f"unknown: {', '.join(unknown)}",
                                              missing and f"missing: {', '.join(missing)}")
                            if part))
        out = cls()
        for name, params in CODEC_PARAMS.items():
            value = data[name]
            loaded = (value if isinstance(value, params)
                      else strict.from_dict(params, value, f"{where}.{name}"))
            problems = loaded.problems()
            if problems:
                knob_name, why = problems[0]
                raise strict.PlanFileError(f"{where}.{name}.{knob_name}: {why}")
            out[name] = loaded
        return out

    def handshake(self) -> dict[str, Any]:
        """What two relays' HELLOs must agree on, of every codec, flat by knob name."""
        return {k: v for params in self.values() for k, v in params.handshake().items()}


_NOUNS = {int: "an integer", float: "a number", bool: "true or false"}


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _has_type(value: Any, kind: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if _is_bool(value):
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def _describe(value: Any) -> str:
    """A found value as the spec's messages show it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)
