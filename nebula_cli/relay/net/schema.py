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
from enum import Enum
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

class _Kind:
    INT, NUMBER, FLAG, TEXT, TEXTS, INTS, NUMBERS, PAIRS, ENUM, MESSAGE, RAW = range(11)


_SCALARS = {int: _Kind.INT, float: _Kind.NUMBER, bool: _Kind.FLAG, str: _Kind.TEXT}


def _kind_of(tp: Any) -> tuple[int, Any]:
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


class _Field:
    """One field of a message: how it is written and read."""

    __slots__ = ("name", "key", "kind", "cls", "bound", "default", "factory", "required",
                 "wanted")

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

    def read(self, what: str, meta: Mapping[str, Any], limits: Mapping[str, int]) -> Any:
        b, k = self.bound, self.kind
        if k == _Kind.MESSAGE and b.flat:
            return _decode_fields(self.cls, what, meta, limits, {})
        v = meta.get(self.key)
        if k == _Kind.MESSAGE and not getattr(self.cls, "LENIENT", False):
            return self.absent() if v is None else _decode(self.cls, what, v, limits, {})
        if k == _Kind.MESSAGE:
            return _decode(self.cls, what, v, limits, {})
        if v is None:
            if self.required:
                raise self._refusal(what, v, missing(what, self.key, self._wanted_at(limits)))
            return self.absent()
        if b.from_wire is not None:
            return b.from_wire(v)
        got = self._typed(what, v, limits)
        if b.choices is not None and got not in b.choices:
            raise self._refusal(what, v, refused(what, self.key, f"one of {b.choices}", v))
        return got

    def _wanted_at(self, limits: Mapping[str, int]) -> str:
        if self.kind == _Kind.INT and isinstance(self.bound.high, str):
            return int_wanted(self.bound.low, limits[self.bound.high])
        return self.wanted

    def _refusal(self, what: str, v: Any, exc: MessageError) -> MessageError:
        return exc if self.bound.error is None else MessageError(self.bound.error.format(v))

    def _typed(self, what: str, v: Any, limits: Mapping[str, int]) -> Any:
        b, k = self.bound, self.kind
        ok = True
        if k == _Kind.INT:
            high = limits[b.high] if isinstance(b.high, str) else b.high
            ok = (is_int(v) and (b.low is None or v >= b.low)
                  and (high is None or v <= high))
        elif k == _Kind.NUMBER:
            ok = is_number(v) and (b.low is None or (v > b.low if b.above else v >= b.low)) \
                and (not b.finite or math.isfinite(v))
            v = float(v) if ok else v
        elif k == _Kind.FLAG:
            ok = isinstance(v, bool)
        elif k == _Kind.TEXT:
            ok = isinstance(v, str) and (b.chars is None or b.chars[0] <= len(v) <= b.chars[1])
            if ok and b.max_chars is not None:
                v = v[:b.max_chars]
        elif k in (_Kind.TEXTS, _Kind.INTS):
            each = (lambda s: isinstance(s, str)) if k == _Kind.TEXTS else is_int
            ok = isinstance(v, list) and all(each(s) for s in v)
            v = tuple(v) if ok else v
        elif k in (_Kind.NUMBERS, _Kind.PAIRS):
            ok = isinstance(v, Mapping) and all(is_number(n) for n in v.values())
            if ok:
                v = {str(name): float(n) for name, n in v.items()}
                v = tuple(sorted(v.items())) if k == _Kind.PAIRS else v
        elif k == _Kind.ENUM:
            try:
                v = self.cls(v)
            except ValueError:
                ok = False
        if not ok:
            raise self._refusal(what, v, refused(what, self.key, self._wanted_at(limits), v))
        return v


class _Plan:
    """A message class as its fields, resolved once."""

    __slots__ = ("cls", "name", "tag", "lenient", "fields", "check")

    def __init__(self, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        self.cls = cls
        self.name: str = getattr(cls, "NAME", cls.__name__)
        self.tag: tuple[str, str] | None = getattr(cls, "TAG", None)
        self.lenient: bool = getattr(cls, "LENIENT", False)
        self.fields = [_Field(f, hints[f.name]) for f in dataclasses.fields(cls)]
        self.check = getattr(cls, "problem", None)


_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _Plan(cls)
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


def decode(cls: type[M], meta: object, *, what: str | None = None,
           limits: Mapping[str, int] | None = None, **given: Any) -> M:
    """Message ``cls`` read from ``meta`` (MessageError: what does not fit, named;
    ``what``: its name in errors, if not ``cls.NAME``). ``limits``: the values of bounds that
    name one; ``given``: the fields that are not on the wire (a frame's payload)."""
    return _decode(cls, what or _plan(cls).name, meta, limits or {}, given)


def _decode(cls: type[M], what: str, meta: object, limits: Mapping[str, int],
            given: Mapping[str, Any]) -> M:
    plan = _plan(cls)
    if plan.lenient and not isinstance(meta, Mapping):
        return cls()
    return _decode_fields(cls, what, object_of(what, meta), limits, given)


def _decode_fields(cls: type[M], what: str, meta: Mapping[str, Any],
                   limits: Mapping[str, int], given: Mapping[str, Any]) -> M:
    plan = _plan(cls)
    values: dict[str, Any] = {}
    for f in plan.fields:
        b = f.bound
        if not b.on_wire:
            values[f.name] = given[f.name] if f.name in given else f.absent()
        elif not b.read or (b.when is not None and not b.when(values)):
            values[f.name] = f.absent()
        elif plan.lenient:
            try:
                values[f.name] = f.read(what, meta, limits)
            except MessageError:
                values[f.name] = f.absent()
        else:
            values[f.name] = f.read(what, meta, limits)
    msg = cls(**values)
    if plan.check is not None and (why := plan.check(msg)):
        raise MessageError(why)
    return msg


# ---------------------------------------------------------------------- reading by hand

class Fields:
    """The fields of one meta read one by one, as a message's fields are (``what``: the
    message's name, for errors): for the few checks that span a frame rather than a field."""

    def __init__(self, what: str, meta: object) -> None:
        self.what, self.meta = what, object_of(what, meta)

    def error(self, key: str, wanted: str) -> MessageError:
        return refused(self.what, key, wanted, self.meta.get(key))

    def _absent(self, key: str, default: Any, wanted: str) -> Any:
        """``default`` for a field that is absent or null (an error when it is REQUIRED)."""
        if default is REQUIRED:
            raise missing(self.what, key, wanted)
        return default

    def integer(self, key: str, default: Any = REQUIRED, *, low: int | None = None,
                high: int | None = None) -> Any:
        """An integer in [low, high] (either bound optional), or ``default``."""
        v = self.meta.get(key)
        if v is None:
            return self._absent(key, default, int_wanted(low, high))
        if not is_int(v) or (low is not None and v < low) or (high is not None and v > high):
            raise self.error(key, int_wanted(low, high))
        return v

    def number(self, key: str, default: Any = REQUIRED, *, low: float | None = None) -> Any:
        """A number (int or float, not bool) of at least ``low``, as a float, or ``default``."""
        wanted = "a number" + (f" >= {low}" if low is not None else "")
        v = self.meta.get(key)
        if v is None:
            return self._absent(key, default, wanted)
        if not is_number(v) or (low is not None and v < low):
            raise self.error(key, wanted)
        return float(v)

    def flag(self, key: str, default: Any = REQUIRED) -> Any:
        """true or false, or ``default``."""
        v = self.meta.get(key)
        if v is None:
            return self._absent(key, default, "true or false")
        if not isinstance(v, bool):
            raise self.error(key, "true or false")
        return v

    def text(self, key: str, default: Any = REQUIRED, *, max_chars: int | None = None) -> Any:
        """A string (cut to ``max_chars``), or ``default``."""
        v = self.meta.get(key)
        if v is None:
            return self._absent(key, default, "a string")
        if not isinstance(v, str):
            raise self.error(key, "a string")
        return v if max_chars is None else v[:max_chars]

    def texts(self, key: str, default: Any = REQUIRED) -> Any:
        """A list of strings, as a tuple, or ``default``."""
        v = self.meta.get(key)
        if v is None:
            return self._absent(key, default, "a list of strings")
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise self.error(key, "a list of strings")
        return tuple(v)

    def integers(self, key: str, default: Any = REQUIRED) -> Any:
        """A list of integers, as a tuple, or ``default``."""
        v = self.meta.get(key)
        if v is None:
            return self._absent(key, default, "a list of integers")
        if not isinstance(v, list) or not all(is_int(i) for i in v):
            raise self.error(key, "a list of integers")
        return tuple(v)

    def numbers(self, key: str, default: Any = REQUIRED) -> Any:
        """An object of numbers by name, as a dict of floats, or ``default``."""
        v = self.meta.get(key)
        if v is None:
            return self._absent(key, default, "an object of numbers")
        if not isinstance(v, Mapping) or not all(is_number(n) for n in v.values()):
            raise self.error(key, "an object of numbers")
        return {str(k): float(n) for k, n in v.items()}

    def choice(self, key: str, kind: type[E], default: Any = REQUIRED) -> Any:
        """One of the values of enum ``kind``, as its member, or ``default``."""
        return choice_of(self.what, self.meta, key, kind, default)

    def raw(self, key: str) -> Any:
        """The value of ``key`` as it came (None when absent)."""
        return self.meta.get(key)
