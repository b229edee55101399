"""Reading a frame's meta into a typed message: each field checked once, here.

Every message of the relay (:mod:`nebula_cli.relay.net.messages` on a peer link,
:mod:`nebula_cli.relay.protocol.messages` for rounds and fetches,
:mod:`nebula_cli.relay.process.worker_messages` on the worker hop) is a frozen dataclass with
one ``from_meta`` that reads its fields through a :class:`Fields` reader, where the frame is
received; nothing past that edge reads a meta dict. A field of the wrong type or out of range
raises :class:`MessageError`, naming the message, the field and what came (so the refusal
says why). Keys a message does not know are ignored (the protocol version in HELLO says which
keys a peer sends); a field that is absent or null takes its default, if it has one.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any, TypeVar

from nebula_cli.relay.net.wire import WireError

E = TypeVar("E", bound=Enum)

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


class Fields:
    """The fields of one message's meta, read one by one (``what``: the message's name, for
    errors)."""

    def __init__(self, what: str, meta: object) -> None:
        if not isinstance(meta, Mapping):
            raise MessageError(f"{what}: expected an object, got {shown(meta)}")
        self.what, self.meta = what, meta

    def error(self, key: str, wanted: str) -> MessageError:
        return MessageError(f"{self.what}: {key} must be {wanted}, got "
                            f"{shown(self.meta.get(key))}")

    def _absent(self, key: str, default: Any, wanted: str) -> Any:
        """``default`` for a field that is absent or null (an error when it is REQUIRED)."""
        if default is REQUIRED:
            raise MessageError(f"{self.what}: {key} is missing (must be {wanted})")
        return default

    def integer(self, key: str, default: Any = REQUIRED, *, low: int | None = None,
                high: int | None = None) -> Any:
        """An integer in [low, high] (either bound optional), or ``default``."""
        wanted = "an integer" + (f" >= {low}" if low is not None else "") + (
            f" <= {high}" if high is not None else "")
        v = self.meta.get(key)
        if v is None:
            return self._absent(key, default, wanted)
        if not is_int(v) or (low is not None and v < low) or (high is not None and v > high):
            raise self.error(key, wanted)
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
        wanted = "one of " + ", ".join(repr(m.value) for m in kind)
        v = self.meta.get(key)
        if v is None:
            return self._absent(key, default, wanted)
        try:
            return kind(v)
        except ValueError:
            raise self.error(key, wanted) from None

    def raw(self, key: str) -> Any:
        """The value of ``key`` as it came (None when absent), for a part that another
        module's own decoder reads (a codec's header, a records offer, a round's info)."""
        return self.meta.get(key)
