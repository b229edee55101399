"""Every relay message declared once: its fields are its encoding and its decoder.

A message of the relay (:mod:`nebula_cli.relay.net.messages` on a peer link,
:mod:`nebula_cli.relay.protocol.messages` for rounds and fetches,
:mod:`nebula_cli.relay.process.worker_messages` on the worker hop,
:mod:`nebula_cli.relay.distill.messages` for soft labels) is a frozen, keyword-only
dataclass; each field says by its type and its :func:`wire` bounds (ranges, lengths, choices,
its key) what it carries. :func:`encode` writes a message's meta from its fields (in their
order: the keys of protocol 2) and :func:`decode` reads one back strictly, where the frame is
received; nothing past that edge reads a meta dict. A field of the wrong type or out of range
raises :class:`MessageError`, naming the message, the field and what came (so the refusal
says why). Keys a message does not know are ignored (the protocol version in HELLO says which
keys a peer sends); a field that is absent or null takes its default, if it has one.

The types a field may have: ``int`` (never a bool), ``float`` (an int or a float, not a bool),
``bool``, ``str``, ``tuple[str, ...]`` and ``tuple[int, ...]`` (JSON lists),
``dict[str, float]`` and ``tuple[tuple[str, float], ...]`` (a JSON object of numbers; the
second sorted by name), an enum (by value), another message (an object under its key, or with
``flat=True`` its fields at this message's top level), ``Any`` (as it came, for a part that
another module's own decoder reads), each of them ``| None``. A message may say, as class
variables, its name in errors (``NAME``), the key and value it is told apart by among its frame
type's messages (``TAG``: written first, read by the dispatcher), and ``LENIENT`` (a value that
does not fit is dropped for its default rather than refused: what a cluster says of its round).
Standard library only: relays load it on hosts from the job's copy.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from enum import Enum, IntEnum
from typing import Any, TypeVar, Union

from nebula_cli.relay.net.wire import WireError

E = TypeVar("E", bound=Enum)
M = TypeVar("M")

REQUIRED: Any = object()
"""The default of a field that must be there."""
SHOWN_CHARS = 80
"""How much of a bad value an error shows."""


class MessageError(WireError):
    """A frame's meta that does not fit its message (the message says which field and why)."""


def is_int(v: object) -> bool:
    """An integer that is not a bool (JSON's true is not a round number)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> bool:
    """An int or a float that is not a bool (JSON numbers are finite)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def shown(v: object) -> str:
    text = repr(v)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def refused(what: str, key: str, wanted: str, v: object) -> MessageError:
    return MessageError(f"{what}: {key} must be {wanted}, got {shown(v)}")


def missing(what: str, key: str, wanted: str) -> MessageError:
    return MessageError(f"{what}: {key} is missing (must be {wanted})")


def int_wanted(low: float | None, high: float | None) -> str:
    return "an integer" + (f" >= {low}" if low is not None else "") + (
        f" <= {high}" if high is not None else "")


def choices_wanted(kind: type[Enum]) -> str:
    return "one of " + ", ".join(repr(m.value) for m in kind)


def object_of(what: str, meta: object) -> Mapping[str, Any]:
    if not isinstance(meta, Mapping):
        raise MessageError(f"{what}: expected an object, got {shown(meta)}")
    return meta


def choice_of(what: str, meta: object, key: str, kind: type[E], default: Any = REQUIRED
              ) -> Any:
    """The member of enum ``kind`` that ``meta[key]`` names (a dispatcher's ``op``), or
    ``default`` when it says none."""
    v = object_of(what, meta).get(key)
    if v is None:
        if default is REQUIRED:
            raise missing(what, key, choices_wanted(kind))
        return default
    try:
        return kind(v)
    except ValueError:
        raise refused(what, key, choices_wanted(kind), v) from None


# ---------------------------------------------------------------------- declaring a field

@dataclasses.dataclass(frozen=True)
class Bound:
    """What a field accepts on the wire beside its type (every part optional)."""

    key: str | None = None
    """Its key in the meta (None: the field's name)."""
    low: float | None = None
    """The least number it may be."""
    high: float | str | None = None
    """The largest integer it may be; a name: the limit of that name given to decode."""
    above: bool = False
    """``low`` itself is refused (a number > low)."""
    finite: bool = False
    """A number that is not finite is refused."""
    max_chars: int | None = None
    """A string is cut to this many characters."""
    chars: tuple[int, int] | None = None
    """A string must have between these many characters (else refused)."""
    choices: tuple[Any, ...] | None = None
    """The values it may take (beside its type)."""
    error: str | None = None
    """The whole refusal when it does not fit, formatted with the value (``{!r}``)."""
    required: bool = False
    """It must be there even though the dataclass has a default (its sender's zero)."""
    omit_default: bool = False
    """Not written when it is its default (and then read as its default)."""
    when: Callable[[Mapping[str, Any]], bool] | None = None
    """Written and read only when this holds of the fields before it (else its default)."""
    flat: bool = False
    """A message whose fields sit at this message's top level (errors name this message)."""
    read: bool = True
    """Read back by the receiver (False: sent for the receiver to show, read as its
    default)."""
    on_wire: bool = True
    """False: not in the meta at all (a frame's payload, given to decode by its caller)."""
    to_wire: Callable[[Any], Any] | None = None
    """How its value is written, when it is not one of the types above."""
    from_wire: Callable[[Any], Any] | None = None
    """How its value is read (raising MessageError), when it is not one of the types."""


def wire(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING,
         **bound: Any) -> Any:
    """A message's field with its :class:`Bound` (``default`` or ``factory`` as in
    ``dataclasses.field``)."""
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"wire": Bound(**bound)})


# ---------------------------------------------------------------------- the plan of a class

class _Kind(IntEnum):
    """What a field's type is on the wire (the scalars first: written as they are)."""

    INT = 0
    NUMBER = 1
    FLAG = 2
    TEXT = 3
    TEXTS = 4
    INTS = 5
    NUMBERS = 6
    PAIRS = 7
    ENUM = 8
    MESSAGE = 9
    RAW = 10


_SCALARS = {int: _Kind.INT, float: _Kind.NUMBER, bool: _Kind.FLAG, str: _Kind.TEXT}


def _kind_of(tp: Any) -> tuple[_Kind, Any]:
    """(kind, the enum or message class) of a resolved annotation, its ``| None`` dropped."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:
            return _kind_of(inner[0])
        return _Kind.RAW, None
    if tp in _SCALARS:
        return _SCALARS[tp], None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if args[0] is str:
            return _Kind.TEXTS, None
        if args[0] is int:
            return _Kind.INTS, None
        if typing.get_origin(args[0]) is tuple:
            return _Kind.PAIRS, None
    if origin is dict and args == (str, float):
        return _Kind.NUMBERS, None
    if isinstance(tp, type) and issubclass(tp, Enum):
        return _Kind.ENUM, tp
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _Kind.MESSAGE, tp
    return _Kind.RAW, None


_WANTED = {_Kind.FLAG: "true or false", _Kind.TEXT: "a string",
           _Kind.TEXTS: "a list of strings", _Kind.INTS: "a list of integers",
           _Kind.NUMBERS: "an object of numbers", _Kind.PAIRS: "an object of numbers",
           _Kind.RAW: "a value"}


_BAD: Any = object()
"""What a conversion gives for a value that does not fit."""
_INF = float("inf")


def _converter(kind: _Kind, cls: Any, b: Bound) -> Callable[[Any, Mapping[str, int]], Any]:
    """The function that gives a wire value as the field's value, or _BAD."""
    if kind == _Kind.INT:
        lo = -_INF if b.low is None else b.low
        if isinstance(b.high, str):
            named = b.high
            return lambda v, lim: v if is_int(v) and lo <= v <= lim[named] else _BAD
        hi = _INF if b.high is None else b.high
        return lambda v, lim: v if (type(v) is int or is_int(v)) and lo <= v <= hi else _BAD
    if kind == _Kind.NUMBER:
        lo, above, finite = (-_INF if b.low is None else b.low), b.above, b.finite

        def number(v: Any, lim: Mapping[str, int]) -> Any:
            if not is_number(v) or (v <= lo if above else v < lo) or (
                    finite and not math.isfinite(v)):
                return _BAD
            return float(v)
        return number
    if kind == _Kind.FLAG:
        return lambda v, lim: v if v is True or v is False else _BAD
    if kind == _Kind.TEXT:
        cut, chars = b.max_chars, b.chars

        def text(v: Any, lim: Mapping[str, int]) -> Any:
            if not isinstance(v, str) or (chars is not None
                                          and not chars[0] <= len(v) <= chars[1]):
                return _BAD
            return v if cut is None else v[:cut]
        return text
    if kind == _Kind.TEXTS:
        return lambda v, lim: tuple(v) if isinstance(v, list) and all(
            isinstance(s, str) for s in v) else _BAD
    if kind == _Kind.INTS:
        return lambda v, lim: tuple(v) if isinstance(v, list) and all(
            is_int(i) for i in v) else _BAD
    if kind in (_Kind.NUMBERS, _Kind.PAIRS):
        pairs = kind == _Kind.PAIRS

        def numbers(v: Any, lim: Mapping[str, int]) -> Any:
            if not isinstance(v, Mapping) or not all(is_number(n) for n in v.values()):
                return _BAD
            got = {str(name): float(n) for name, n in v.items()}
            return tuple(sorted(got.items())) if pairs else got
        return numbers
    if kind == _Kind.ENUM:
        members = cls._value2member_map_

        def member(v: Any, lim: Mapping[str, int]) -> Any:
            try:
                m = members.get(v)
            except TypeError:  # unhashable: not a value of it
                return _BAD
            if m is None:
                try:
                    return cls(v)
                except ValueError:
                    return _BAD
            return m
        return member
    return lambda v, lim: v


_Take = Callable[[str, Mapping[str, Any], Mapping[str, int], dict[str, Any], Mapping[str, Any]],
                 Any]
"""A field's reader: (what, meta, limits, the fields read so far, given) -> its value."""


class _Field:
    """One field of a message: how it is written and read (both built once, per class)."""

    __slots__ = ("name", "key", "kind", "cls", "bound", "default", "factory", "required",
                 "wanted", "take")

    def __init__(self, f: dataclasses.Field, tp: Any) -> None:
        self.name = f.name
        self.bound: Bound = f.metadata.get("wire", Bound())
        self.key = self.bound.key or f.name
        self.kind, self.cls = _kind_of(tp)
        if self.bound.to_wire is not None or self.bound.from_wire is not None:
            self.kind, self.cls = _Kind.RAW, None
        self.default = f.default
        self.factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
        self.required = self.bound.required or (
            f.default is dataclasses.MISSING and self.factory is None)
        self.wanted = self._wanted()
        self.take = self._taker()

    def _wanted(self) -> str:
        b = self.bound
        if self.kind == _Kind.INT:
            return "" if isinstance(b.high, str) else int_wanted(b.low, b.high)
        if self.kind == _Kind.NUMBER:
            return "a number" + (f" >= {b.low}" if b.low is not None else "")
        if self.kind == _Kind.ENUM:
            return choices_wanted(self.cls)
        return _WANTED.get(self.kind, "")

    def absent(self) -> Any:
        """Its value when it is not read: the dataclass's default."""
        return self.factory() if self.factory is not None else self.default

    # -- writing

    def write(self, v: Any) -> Any:
        b, k = self.bound, self.kind
        if b.to_wire is not None:
            return None if v is None else b.to_wire(v)
        if v is None or k <= _Kind.TEXT or k == _Kind.RAW:
            return v
        if k in (_Kind.TEXTS, _Kind.INTS):
            return list(v)
        if k in (_Kind.NUMBERS, _Kind.PAIRS):
            return dict(v)
        if k == _Kind.ENUM:
            return v.value
        return encode(v)

    # -- reading

    def _taker(self) -> _Take:
        b, name, absent = self.bound, self.name, self.absent
        if not b.on_wire:
            return lambda what, meta, lim, values, given: (
                given[name] if name in given else absent())
        if not b.read:
            return lambda what, meta, lim, values, given: absent()
        read = self._reader()
        when = b.when
        if when is None:
            return lambda what, meta, lim, values, given: read(what, meta, lim)
        return lambda what, meta, lim, values, given: (
            read(what, meta, lim) if when(values) else absent())

    def _reader(self) -> Callable[[str, Mapping[str, Any], Mapping[str, int]], Any]:
        b, k, key, absent = self.bound, self.kind, self.key, self.absent
        if k == _Kind.MESSAGE:
            sub = _plan(self.cls)
            if b.flat:
                return lambda what, meta, lim: sub.fields_of(what, meta, lim, {})
            if sub.lenient:
                return lambda what, meta, lim: sub.read(what, meta.get(key), lim, {})
            return lambda what, meta, lim: (
                absent() if (v := meta.get(key)) is None else sub.read(what, v, lim, {}))
        convert = b.from_wire or _converter(k, self.cls, b)
        custom = b.from_wire is not None
        required, choices = self.required, b.choices

        def read(what: str, meta: Mapping[str, Any], lim: Mapping[str, int]) -> Any:
            v = meta.get(key)
            if v is None:
                if required:
                    raise self._refusal(v, missing(what, key, self._wanted_at(lim)))
                return absent()
            if custom:
                return convert(v)
            got = convert(v, lim)
            if got is _BAD:
                raise self._refusal(v, refused(what, key, self._wanted_at(lim), v))
            if choices is not None and got not in choices:
                raise self._refusal(v, refused(what, key, f"one of {choices}", v))
            return got
        return read

    def _wanted_at(self, limits: Mapping[str, int]) -> str:
        if self.kind == _Kind.INT and isinstance(self.bound.high, str):
            return int_wanted(self.bound.low, limits[self.bound.high])
        return self.wanted

    def _refusal(self, v: Any, exc: MessageError) -> MessageError:
        return exc if self.bound.error is None else MessageError(self.bound.error.format(v))


class _Plan:
    """A message class as its fields, resolved once."""

    __slots__ = ("cls", "name", "tag", "lenient", "fields", "check")

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name: str = getattr(cls, "NAME", cls.__name__)
        self.tag: tuple[str, str] | None = getattr(cls, "TAG", None)
        self.lenient: bool = getattr(cls, "LENIENT", False)
        self.check = getattr(cls, "problem", None)
        self.fields: list[_Field] = []

    def resolve(self) -> None:
        hints = typing.get_type_hints(self.cls)
        self.fields = [_Field(f, hints[f.name]) for f in dataclasses.fields(self.cls)]

    def read(self, what: str, meta: object, limits: Mapping[str, int],
             given: Mapping[str, Any]) -> Any:
        """The message from ``meta`` (an object; with LENIENT anything, else its default)."""
        if type(meta) is not dict and not isinstance(meta, Mapping):
            if self.lenient:
                return self.cls()
            object_of(what, meta)
        return self.fields_of(what, meta, limits, given)

    def fields_of(self, what: str, meta: Mapping[str, Any], limits: Mapping[str, int],
                  given: Mapping[str, Any]) -> Any:
        values: dict[str, Any] = {}
        if self.lenient:
            for f in self.fields:
                try:
                    values[f.name] = f.take(what, meta, limits, values, given)
                except MessageError:
                    values[f.name] = f.absent()
        else:
            for f in self.fields:
                values[f.name] = f.take(what, meta, limits, values, given)
        msg = self.cls(**values)
        if self.check is not None and (why := self.check(msg)):
            raise MessageError(why)
        return msg


_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _Plan(cls)
        plan.resolve()  # after it is known: a message may hold its own kind
    return plan


# ---------------------------------------------------------------------- encode, decode

def encode(msg: Any) -> dict[str, Any]:
    """The meta of message ``msg``: its tag, then each field under its key, in order."""
    plan = _plan(type(msg))
    out: dict[str, Any] = {}
    if plan.tag is not None:
        out[plan.tag[0]] = plan.tag[1]
    values = msg.__dict__
    for f in plan.fields:
        b = f.bound
        if not b.on_wire or (b.when is not None and not b.when(values)):
            continue
        v = values[f.name]
        if b.omit_default and v == f.absent():
            continue
        if f.kind == _Kind.MESSAGE and b.flat:
            out.update(encode(v))
        else:
            out[f.key] = f.write(v)
    return out


_NO_LIMITS: Mapping[str, int] = {}


def decode(cls: type[M], meta: object, *, what: str | None = None,
           limits: Mapping[str, int] | None = None, **given: Any) -> M:
    """Message ``cls`` read from ``meta`` (MessageError: what does not fit, named;
    ``what``: its name in errors, if not ``cls.NAME``). ``limits``: the values of bounds that
    name one; ``given``: the fields that are not on the wire (a frame's payload)."""
    plan = _PLANS.get(cls) or _plan(cls)
    return plan.read(what or plan.name, meta, limits or _NO_LIMITS, given)
