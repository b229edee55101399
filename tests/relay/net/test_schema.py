"""relay/net/schema.py: a message's fields are read once, strictly; what is wrong is named."""

from __future__ import annotations

from enum import StrEnum

import pytest

from nebula_cli.relay.net.schema import REQUIRED, Fields, MessageError, is_int, is_number
from nebula_cli.relay.net.wire import WireError


class Colour(StrEnum):
    RED = "red"
    BLUE = "blue"


def test_ints_and_numbers_are_never_bools() -> None:
    assert is_int(3) and is_int(-1) and not is_int(True) and not is_int(3.0)
    assert not is_int("3") and not is_int(None)
    assert is_number(3) and is_number(0.5) and not is_number(False) and not is_number("1")


def test_fields_of_the_right_type_are_read() -> None:
    f = Fields("MSG", {"n": 3, "x": 2, "ok": False, "s": "abcdef", "l": ["a", "b"],
                       "i": [1, 2], "w": {"a": 1, "b": 2.5}, "c": "blue", "o": {"k": 1}})
    assert f.integer("n", low=0, high=3) == 3
    assert f.number("x") == 2.0 and isinstance(f.number("x"), float)
    assert f.flag("ok") is False
    assert f.text("s") == "abcdef" and f.text("s", max_chars=3) == "abc"
    assert f.texts("l") == ("a", "b") and f.integers("i") == (1, 2)
    assert f.numbers("w") == {"a": 1.0, "b": 2.5}
    assert f.choice("c", Colour) is Colour.BLUE
    assert f.raw("o") == {"k": 1} and f.raw("absent") is None


def test_absent_or_null_fields_take_their_default_or_are_missing() -> None:
    f = Fields("MSG", {"n": None})
    assert f.integer("n", -1) == -1 and f.integer("gone", None) is None
    assert f.text("gone", "") == "" and f.texts("gone", ()) == ()
    assert f.flag("gone", True) is True and f.choice("gone", Colour, None) is None
    for read in (f.integer, f.number, f.flag, f.text, f.texts, f.integers, f.numbers):
        with pytest.raises(MessageError, match="MSG: n is missing"):
            read("n", REQUIRED)


@pytest.mark.parametrize("meta, read, words", [
    ({"n": True}, lambda f: f.integer("n"), "n must be an integer, got True"),
    ({"n": "3"}, lambda f: f.integer("n"), "n must be an integer, got '3'"),
    ({"n": -2}, lambda f: f.integer("n", low=-1), "n must be an integer >= -1, got -2"),
    ({"n": 5}, lambda f: f.integer("n", low=0, high=2), "integer >= 0 <= 2, got 5"),
    ({"x": "1.5"}, lambda f: f.number("x"), "x must be a number"),
    ({"x": -1.0}, lambda f: f.number("x", low=0.0), "x must be a number >= 0.0"),
    ({"ok": 1}, lambda f: f.flag("ok"), "ok must be true or false, got 1"),
    ({"s": 7}, lambda f: f.text("s"), "s must be a string"),
    ({"l": ["a", 1]}, lambda f: f.texts("l"), "l must be a list of strings"),
    ({"l": "ab"}, lambda f: f.texts("l"), "l must be a list of strings"),
    ({"i": [1, True]}, lambda f: f.integers("i"), "i must be a list of integers"),
    ({"w": {"a": "1"}}, lambda f: f.numbers("w"), "w must be an object of numbers"),
    ({"c": "green"}, lambda f: f.choice("c", Colour), "c must be one of 'red', 'blue'"),
])
def test_a_field_of_the_wrong_type_is_refused_with_its_name(meta: dict, read, words: str
                                                           ) -> None:
    with pytest.raises(MessageError, match=words) as exc:
        read(Fields("MSG", meta))
    assert str(exc.value).startswith("MSG: ")
    assert isinstance(exc.value, WireError)  # a protocol error: the link or session ends


def test_a_meta_that_is_not_an_object_and_long_values_are_shown_short() -> None:
    with pytest.raises(MessageError, match="MSG: expected an object"):
        Fields("MSG", ["not", "a", "dict"])
    with pytest.raises(MessageError) as exc:
        Fields("MSG", {"s": ["x" * 1000]}).text("s")
    assert len(str(exc.value)) < 200 and str(exc.value).endswith("...")
