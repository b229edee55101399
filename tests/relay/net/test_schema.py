"""relay/net/schema.py: a message is declared once; its fields are its encoding and its strict
decoder, and what is wrong is named."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

import pytest

from nebula_cli.relay.net.schema import (
    MessageError,
    choice_of,
    decode,
    encode,
    is_int,
    is_number,
    wire,
)
from nebula_cli.relay.net.wire import WireError


class Colour(StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, kw_only=True)
class Inner:
    NAME: ClassVar[str] = "INNER"

    depth: int | None = wire(None, key="inner_depth", low=1)


@dataclass(frozen=True, kw_only=True)
class Said:
    """Read leniently: what does not fit is dropped."""

    LENIENT: ClassVar[bool] = True

    w: float | None = wire(None, low=0.0, above=True, finite=True, omit_default=True)
    name: str | None = wire(None, chars=(1, 4), omit_default=True)


@dataclass(frozen=True, kw_only=True)
class Msg:
    """Every kind of field, each required."""

    NAME: ClassVar[str] = "MSG"
    TAG: ClassVar[tuple[str, str]] = ("op", "msg")

    n: int = wire(low=0, high=3)
    x: float
    ok: bool
    s: str = wire(max_chars=3)
    l: tuple[str, ...]  # noqa: E741
    i: tuple[int, ...]
    w: dict[str, float]
    c: Colour
    o: Any


@dataclass(frozen=True, kw_only=True)
class Optional_:
    """Every kind of field, each with a default."""

    NAME: ClassVar[str] = "MSG"

    n: int = -1
    gone: int | None = None
    s: str = ""
    l: tuple[str, ...] = ()  # noqa: E741
    ok: bool = True
    c: Colour | None = None


def one(kind: str, **bound: Any) -> type:
    """A message "MSG" of one required field ``v`` of type ``kind`` with ``bound``."""
    ns: dict[str, Any] = {"__annotations__": {"NAME": "ClassVar[str]", "v": kind},
                          "NAME": "MSG", "v": wire(**bound)}
    return dataclass(frozen=True, kw_only=True)(type("One", (), ns))


def test_ints_and_numbers_are_never_bools() -> None:
    assert is_int(3) and is_int(-1) and not is_int(True) and not is_int(3.0)
    assert not is_int("3") and not is_int(None)
    assert is_number(3) and is_number(0.5) and not is_number(False) and not is_number("1")


def test_fields_of_the_right_type_are_read() -> None:
    got = decode(Msg, {"n": 3, "x": 2, "ok": False, "s": "abcdef", "l": ["a", "b"],
                       "i": [1, 2], "w": {"a": 1, "b": 2.5}, "c": "blue", "o": {"k": 1}})
    assert got.n == 3
    assert got.x == 2.0 and isinstance(got.x, float)
    assert got.ok is False
    assert got.s == "abc"  # cut to max_chars
    assert got.l == ("a", "b") and got.i == (1, 2)
    assert got.w == {"a": 1.0, "b": 2.5}
    assert got.c is Colour.BLUE
    assert got.o == {"k": 1}


def test_the_encoding_is_the_tag_then_each_field_in_order_and_reads_back() -> None:
    msg = Msg(n=1, x=0.5, ok=True, s="ab", l=("a",), i=(4,), w={"a": 1.0}, c=Colour.RED,
              o=[1])
    meta = encode(msg)
    assert list(meta) == ["op", "n", "x", "ok", "s", "l", "i", "w", "c", "o"]
    assert meta["c"] == "red" and meta["l"] == ["a"] and meta["op"] == "msg"
    assert decode(Msg, json.loads(json.dumps(meta))) == msg
    with pytest.raises(TypeError):
        Msg(1, 0.5, True, "ab", ("a",), (4,), {}, Colour.RED, None)  # type: ignore[misc]


def test_absent_or_null_fields_take_their_default_or_are_missing() -> None:
    got = decode(Optional_, {"n": None})
    assert got.n == -1 and got.gone is None
    assert got.s == "" and got.l == ()
    assert got.ok is True and got.c is None
    for kind in ("int", "float", "bool", "str", "tuple[str, ...]", "tuple[int, ...]",
                 "dict[str, float]"):
        with pytest.raises(MessageError, match="MSG: v is missing"):
            decode(one(kind), {"v": None})


@pytest.mark.parametrize("kind, bound, meta, words", [
    ("int", {}, {"v": True}, "v must be an integer, got True"),
    ("int", {}, {"v": "3"}, "v must be an integer, got '3'"),
    ("int", {"low": -1}, {"v": -2}, "v must be an integer >= -1, got -2"),
    ("int", {"low": 0, "high": 2}, {"v": 5}, "integer >= 0 <= 2, got 5"),
    ("float", {}, {"v": "1.5"}, "v must be a number"),
    ("float", {"low": 0.0}, {"v": -1.0}, "v must be a number >= 0.0"),
    ("bool", {}, {"v": 1}, "v must be true or false, got 1"),
    ("str", {}, {"v": 7}, "v must be a string"),
    ("tuple[str, ...]", {}, {"v": ["a", 1]}, "v must be a list of strings"),
    ("tuple[str, ...]", {}, {"v": "ab"}, "v must be a list of strings"),
    ("tuple[int, ...]", {}, {"v": [1, True]}, "v must be a list of integers"),
    ("dict[str, float]", {}, {"v": {"a": "1"}}, "v must be an object of numbers"),
    ("Colour", {}, {"v": "green"}, "v must be one of 'red', 'blue'"),
    ("Colour", {}, {"v": ["red"]}, "v must be one of 'red', 'blue'"),
    ("int", {"choices": (1, 2)}, {"v": 3}, r"v must be one of \(1, 2\), got 3"),
])
def test_a_field_of_the_wrong_type_is_refused_with_its_name(kind: str, bound: dict, meta: dict,
                                                           words: str) -> None:
    with pytest.raises(MessageError, match=words) as exc:
        decode(one(kind, **bound), meta)
    assert str(exc.value).startswith("MSG: ")
    assert isinstance(exc.value, WireError)  # a protocol error: the link or session ends


def test_a_meta_that_is_not_an_object_and_long_values_are_shown_short() -> None:
    with pytest.raises(MessageError, match="MSG: expected an object"):
        decode(Optional_, ["not", "a", "dict"])
    with pytest.raises(MessageError) as exc:
        decode(one("str"), {"v": ["x" * 1000]})
    assert len(str(exc.value)) < 200 and str(exc.value).endswith("...")
    with pytest.raises(MessageError, match="MSG: op must be one of 'red', 'blue'"):
        choice_of("MSG", {"op": "green"}, "op", Colour)
    assert choice_of("MSG", {}, "op", Colour, None) is None


def test_a_bound_may_name_a_limit_given_where_the_frame_is_read() -> None:
    cls = one("int", low=1, high="max_tokens")
    assert decode(cls, {"v": 16}, limits={"max_tokens": 16}).v == 16
    with pytest.raises(MessageError, match="MSG: v must be an integer >= 1 <= 16, got 17"):
        decode(cls, {"v": 17}, limits={"max_tokens": 16})


def test_a_nested_message_sits_under_its_key_or_flat_and_errors_name_the_outer() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Outer:
        NAME: ClassVar[str] = "OUTER"
        inner: Inner = wire(Inner(), flat=True)
        said: Said = Said()

    out = Outer(inner=Inner(depth=2), said=Said(w=1.5))
    assert encode(out) == {"inner_depth": 2, "said": {"w": 1.5}}
    assert decode(Outer, encode(out)) == out
    with pytest.raises(MessageError, match="OUTER: inner_depth must be an integer >= 1"):
        decode(Outer, {"inner_depth": 0})
    with pytest.raises(MessageError, match="RESULT: inner_depth"):
        decode(Outer, {"inner_depth": "2"}, what="RESULT")


def test_a_lenient_message_drops_what_does_not_fit() -> None:
    assert decode(Said, {"w": 0.0, "name": "toolong"}) == Said()
    assert decode(Said, {"w": float("inf"), "name": ""}) == Said()
    assert decode(Said, "junk") == Said() and encode(Said()) == {}
    assert decode(Said, {"w": 2, "name": "abcd"}) == Said(w=2.0, name="abcd")


def test_conditional_omitted_and_given_fields_and_a_messages_own_check() -> None:
    def says_size(values: Any) -> bool:
        return values["status"] == "ok"

    @dataclass(frozen=True, kw_only=True)
    class Answer:
        NAME: ClassVar[str] = "ANSWER"
        status: str
        numel: int = wire(0, when=says_size, required=True, low=0)
        shm: int | None = wire(None, omit_default=True)
        payload: bytes = wire(b"", on_wire=False)
        parts: int = wire(1, choices=(1, 2), error="a tensor in {!r} parts")

        def problem(self) -> str | None:
            return "an empty answer" if self.status == "empty" else None

    assert encode(Answer(status="busy", shm=None)) == {"status": "busy", "parts": 1}
    assert encode(Answer(status="ok", numel=4, shm=7)) == {"status": "ok", "numel": 4,
                                                           "shm": 7, "parts": 1}
    assert decode(Answer, {"status": "busy"}) == Answer(status="busy")
    assert decode(Answer, {"status": "ok", "numel": 4}, payload=b"ab").payload == b"ab"
    with pytest.raises(MessageError, match="ANSWER: numel is missing"):
        decode(Answer, {"status": "ok"})
    with pytest.raises(MessageError, match="^a tensor in True parts$"):
        decode(Answer, {"status": "busy", "parts": True})
    with pytest.raises(MessageError, match="an empty answer"):
        decode(Answer, {"status": "empty"})
