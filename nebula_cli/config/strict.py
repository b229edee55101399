"""Strict loading of the plan's parts: frozen dataclasses from JSON, unknown keys refused.

The host-side processes (agent, relay, runtime) load their part of the job's plan with these
helpers, so they keep to the standard library. A part has no defaults of its own: every value
comes from the plan, which takes it from the spec (the one place defaults live).
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union

from nebula_cli.errors import NebulaError

T = TypeVar("T")

PLAN_FILE_MODE = 0o600


class PlanFileError(NebulaError):
    """A plan part that cannot be used: unreadable, malformed, unknown or missing keys."""


def _check(tp: Any, value: Any, where: str) -> Any:
    """`value` converted to `tp` (nested dataclasses built), or PlanFileError saying why."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(arg, value, where)
            except PlanFileError as exc:
                errors.append(str(exc))
        raise PlanFileError(errors[0] if errors else f"{where}: unexpected {value!r}")
    if isinstance(tp, type) and hasattr(tp, "from_plan"):  # a part that loads itself
        return tp.from_plan(value, where)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)  # type: ignore[arg-type]
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise PlanFileError(f"{where}: expected a list, found {value!r}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        items = [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise PlanFileError(f"{where}: expected a mapping, found {value!r}")
        kt, vt = typing.get_args(tp) or (Any, Any)
        return {_check(kt, k, where): _check(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PlanFileError(f"{where}: expected a number, found {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanFileError(f"{where}: expected an integer, found {value!r}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise PlanFileError(f"{where}: expected {tp.__name__}, found {value!r}")
        return value
    raise PlanFileError(f"{where}: cannot check type {tp!r}")  # a programming error


def from_dict(cls: type[T], data: Any, what: str | None = None) -> T:
    """Build dataclass `cls` from a mapping: every field required, no unknown key, types
    checked (ints are not booleans, numbers are not strings)."""
    what = what or cls.__name__
    if not isinstance(data, dict):
        raise PlanFileError(f"{what}: expected a mapping, found {data!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise PlanFileError(f"{what}: unknown key(s) {', '.join(unknown)}; known: "
                            f"{', '.join(known)}")
    missing = [k for k in known if k not in data]
    if missing:
        raise PlanFileError(f"{what}: missing key(s) {', '.join(missing)}")
    values = {k: _check(hints[k], data[k], f"{what}.{k}") for k in known}
    return cls(**values)


def to_dict(part: Any) -> dict[str, Any]:
    """The JSON-ready form of a dataclass part."""
    return dataclasses.asdict(part)


def dumps(part: Any) -> bytes:
    return (json.dumps(to_dict(part), indent=1, sort_keys=True) + "\n").encode()


def load(cls: type[T], path: str | Path) -> T:
    """Read a part written by `dumps` (or `write`)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlanFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise PlanFileError(f"{path} is not valid JSON: {exc}") from exc
    return from_dict(cls, data, f"{path.name}")


def write(part: Any, path: str | Path) -> None:
    """Write a part atomically, readable by its owner only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PLAN_FILE_MODE)
    with os.fdopen(fd, "wb") as fh:
        fh.write(dumps(part))
    os.replace(tmp, path)
