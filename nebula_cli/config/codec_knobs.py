"""What a WAN codec is to the plan, without torch: the base of every codec's params class
(:class:`CodecParams`) and its knobs (:func:`knob`), with the checks a loaded plan's values
pass (`CodecParams.problems`, worded as the spec words them).

A codec is described by one frozen dataclass, a subclass of :class:`CodecParams`, in its own
package's ``params`` module (`nebula_cli/codecs/<name>/params.py`, registered in
`nebula_cli/codecs/registry.py`): its class attributes say what the codec is (``name`` on the
wire, ``sparse``, ``rel_error``, whether ``compression: auto`` may choose it, the outer lr and
momentum a round with it takes when the spec names none), its fields are its knobs (each made
by :func:`knob`: the default, defined there once, and the values the spec accepts), and its
methods derive what the plan needs from the knobs' values (``bytes_per_element``, ``label``,
``handshake``). The catalog by name is `codec_params.CODEC_PARAMS`. Standard library only:
host processes load the plan.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

DENSE_OUTER = (0.6, 0.5)
"""The outer lr and Nesterov momentum of a round of a dense codec: a codec's unless it says
otherwise. 0.6 / 0.5 loses at most 3 % of eval loss against flat data parallel with int8 at 2,
5 and 20 rounds (bench/diloco_schedule.py, three seeds); DiLoCo's 0.7 / 0.9, chosen for runs of
hundreds of rounds, lost 4.8-8.3 % at 2 and 5 rounds (docs/benchmarks.md, "A default safe at
every length")."""
FEEDBACK_DECAY = 1.0
"""The error feedback's decay beta of a codec that names none (`CodecParams.feedback_decay`,
`compression.feedback_decay`): 1 carries every unsent part until it is sent; below 1 an unsent
part fades by beta a round (SparseLoCo)."""
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
    feedback_decay: ClassVar[float] = FEEDBACK_DECAY
    """The error feedback's decay beta of a round with this codec when the spec names none."""
    auto: ClassVar[bool] = False
    """``compression: auto`` may choose it (`codec_params.AUTO_CODECS`)."""

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
