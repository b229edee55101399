"""YAML to plain data that remembers where every node was written, and errors placed there.

`load_located(text)` composes the document with PyYAML's safe loader, builds dicts, lists and
scalars (SafeLoader semantics, merge keys included) and records, for every path such as
``("clusters", 1, "hosts", 0, "slots")``, where its value starts and, for mapping entries, where
its key starts. Duplicate keys in one mapping are collected rather than silently overwritten.
Malformed YAML raises `yaml.YAMLError` (with a `problem_mark` where PyYAML knows one).

The input may be hostile: nesting deeper than `MAX_DEPTH` is refused before anything recurses,
and aliases (``*name``) and merge keys are expanded against a budget of `MAX_VALUES` values, so
an alias bomb ("billion laughs") is refused while it is expanded, in milliseconds. libyaml
parses when it is installed (ten times faster); errors are worded by PyYAML's own parser.

`validation_problems(exc, located, file, root)` turns a pydantic `ValidationError` into one
`SpecError` per problem, at the line/column of the offending node, in plain English.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.error import MarkedYAMLError
from yaml.events import CollectionEndEvent, CollectionStartEvent, NodeEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.reader import ReaderError

from nebula_cli.errors import SpecError

PathKey = tuple[Any, ...]
Position = tuple[int, int]  # (line, column), both 1-based

_MERGE_TAG = "tag:yaml.org,2002:merge"
_VALUE_TAG = "tag:yaml.org,2002:value"
_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: fast

MAX_DEPTH = 32
"""Deepest nesting of mappings and lists in a spec (a real one needs fewer than 10)."""
MAX_VALUES = 50_000
"""Most values a spec may hold, counting what aliases and merge keys expand to."""
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


class SpecTooLarge(MarkedYAMLError):
    """A document nested deeper than MAX_DEPTH or larger than MAX_VALUES: refused."""


@dataclass
class Duplicate:
    """A key written twice in one mapping: its path, where it is repeated and where it was first."""

    path: PathKey
    at: Position
    first: Position


@dataclass
class Located:
    """Plain data plus where each part of it was written."""

    data: Any
    values: dict[PathKey, Position] = field(default_factory=dict)
    """Path -> position of the value node (the root is the empty path)."""
    keys: dict[PathKey, Position] = field(default_factory=dict)
    """Path -> position of the key node of a mapping entry."""
    duplicates: list[Duplicate] = field(default_factory=list)

    def position(self, path: PathKey, *, key: bool = False) -> Position:
        """Where `path` was written; falls back to the nearest enclosing node that exists."""
        if key and path in self.keys:
            return self.keys[path]
        while path and path not in self.values:
            path = path[:-1]
        return self.values.get(path, (1, 1))


def _pos(node: Node) -> Position:
    return node.start_mark.line + 1, node.start_mark.column + 1


class _Builder:
    def __init__(self) -> None:
        self.constructor = SafeConstructor()
        self.out = Located(data=None)
        self._stack: set[int] = set()
        self._merged: dict[int, list[tuple[Node, Node]]] = {}
        self._budget = MAX_VALUES

    def _spend(self, node: Node) -> None:
        self._budget -= 1
        if self._budget < 0:
            raise SpecTooLarge(
                None, None, f"the document expands to more than {MAX_VALUES} values (aliases "
                "'*name' and merge keys '<<' repeat what their anchor holds); a spec is far "
                "smaller", node.start_mark)

    def build(self, node: Node, path: PathKey) -> Any:
        self._spend(node)
        if len(path) > MAX_DEPTH:
            raise SpecTooLarge(None, None, f"nested more than {MAX_DEPTH} levels deep",
                                node.start_mark)
        self.out.values[path] = _pos(node)
        if isinstance(node, ScalarNode):
            return self._scalar(node)
        if id(node) in self._stack:
            raise ConstructorError(None, None, "found a recursive alias", node.start_mark)
        self._stack.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
            if isinstance(node, MappingNode):
                return self._mapping(node, path)
            raise ConstructorError(None, None, f"unexpected node {node.id}", node.start_mark)
        finally:
            self._stack.discard(id(node))

    def _scalar(self, node: ScalarNode) -> Any:
        try:
            return self.constructor.construct_object(node, deep=True)
        except yaml.YAMLError:
            raise
        except Exception as exc:  # !!int abc, a 5000-digit integer, !!timestamp junk
            reason = str(exc).split(";")[0]
            raise ConstructorError(None, None, f"cannot read {describe(node.value)} as "
                                   f"{node.tag.rsplit(':', 1)[-1]}: {reason}",
                                   node.start_mark) from exc

    def _mapping(self, node: MappingNode, path: PathKey) -> dict[Any, Any]:
        first: dict[Any, Position] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self._key(key_node)
            if key in first:
                self.out.duplicates.append(Duplicate((*path, key), _pos(key_node), first[key]))
            else:
                first[key] = _pos(key_node)
        result: dict[Any, Any] = {}
        for key_node, value_node in self._entries(node, frozenset()):
            key = self._key(key_node)
            self.out.keys[(*path, key)] = _pos(key_node)
            result[key] = self.build(value_node, (*path, key))
        return result

    def _entries(self, node: MappingNode, outer: frozenset[int]) -> list[tuple[Node, Node]]:
        """The mapping's entries with merge keys resolved as SafeLoader does (explicit entries
        win, then earlier merge sources over later ones), each key once, nothing mutated."""
        if id(node) in self._merged:
            return self._merged[id(node)]
        if id(node) in outer:
            raise ConstructorError(None, None, "found a recursive merge", node.start_mark)
        sources: list[MappingNode] = []
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE_TAG:
                continue
            subs = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
            if bad := [n for n in subs if not isinstance(n, MappingNode)]:
                raise ConstructorError("while constructing a mapping", node.start_mark,
                                       f"expected a mapping for merging, found {bad[0].id}",
                                       bad[0].start_mark)
            sources += reversed(subs) if isinstance(value_node, SequenceNode) else subs
        if not sources:
            return node.value
        entries: dict[Any, tuple[Node, Node]] = {}
        own = [(k, v) for k, v in node.value if k.tag != _MERGE_TAG]
        for source in sources:
            for key_node, value_node in [*self._entries(source, outer | {id(node)})]:
                self._spend(key_node)
                entries[self._key(key_node)] = (key_node, value_node)
        for key_node, value_node in own:
            entries[self._key(key_node)] = (key_node, value_node)
        self._merged[id(node)] = list(entries.values())
        return self._merged[id(node)]

    def _key(self, node: Node) -> Any:
        if not isinstance(node, ScalarNode):
            raise ConstructorError(
                None, None, "mapping keys must be plain scalars", node.start_mark
            )
        return node.value if node.tag == _VALUE_TAG else self._scalar(node)


def _scan(text: str, loader: type = _FAST_LOADER) -> None:
    """Refuse a document nested deeper than MAX_DEPTH or with more than MAX_VALUES nodes before
    anything recursive reads it. Syntax errors are left to the composer, which words them.
    libyaml's scanner stops at nesting limits of its own (1000 levels, looking ahead before
    any event), so an error of the fast parser is scanned again by the pure-Python one, which
    reaches ours first."""
    depth = count = 0
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, NodeEvent):
                count += 1
                if count > MAX_VALUES:
                    raise SpecTooLarge(None, None, f"the document holds more than {MAX_VALUES} "
                                        "values; a spec is far smaller", event.start_mark)
            if isinstance(event, CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise SpecTooLarge(None, None, f"nested more than {MAX_DEPTH} levels deep",
                                        event.start_mark)
            elif isinstance(event, CollectionEndEvent):
                depth -= 1
    except SpecTooLarge:
        raise
    except yaml.YAMLError:
        if loader is not yaml.SafeLoader:
            _scan(text, yaml.SafeLoader)


def load_located(text: str) -> Located:
    """Parse one YAML document; an empty document gives ``data=None``."""
    _scan(text)
    try:
        root = yaml.compose(text, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        if _FAST_LOADER is yaml.SafeLoader:
            raise
        try:  # the pure-Python loader again, for its (clearer) wording of the error
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except RecursionError as exc:  # only if libyaml and PyYAML disagree
            raise SpecTooLarge(None, None, "nested too deeply", None) from exc
    builder = _Builder()
    if root is not None:
        builder.out.data = builder.build(root, ())
    return builder.out


def control_characters(located: Located) -> list[tuple[PathKey, bool, str]]:
    """(path, on the key, character) of each string, key or value, holding a control character
    other than tab and newline (escapes such as "\\0" or "\\e" in double quotes)."""
    found: list[tuple[PathKey, bool, str]] = []
    todo: list[tuple[PathKey, Any]] = [((), located.data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and (m := _CONTROL_RE.search(key)):
                    found.append(((*path, key), True, m.group()))
                todo.append(((*path, key), item))
        elif isinstance(value, list):
            todo.extend(((*path, i), item) for i, item in enumerate(value))
        elif isinstance(value, str) and (m := _CONTROL_RE.search(value)):
            found.append((path, False, m.group()))
    return found


# ---- validation errors, placed and in plain English -----------------------------------------

_PROBLEMS = "positioned_problems"
# pydantic loc entries that name a union member or validator rather than a field
_LOC_TAG_RE = re.compile(r"[a-z-]+\[.*\]|str|int|float|bool|none|dict|list")
_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "true or false", "bool_parsing": "true or false", "string_type": "a string",
    "dict_type": "a mapping", "model_type": "a mapping", "model_attributes_type": "a mapping",
    "list_type": "a list",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
           "less_than_equal": "<="}


def problems_error(items: list[tuple[PathKey, str]]) -> PydanticCustomError:
    """For model validators: several problems at once, each at a path relative to the model."""
    summary = "; ".join(message for _, message in items)
    return PydanticCustomError(_PROBLEMS, "{summary}", {"summary": summary, "problems": items})


def describe(value: Any) -> str:
    """How a found value is shown in messages."""
    if value is None:
        return "an empty value"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    return str(value)


def format_path(path: PathKey) -> str:
    """("clusters", 1, "hosts", 0, "slots") -> "clusters[1].hosts[0].slots"."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier():
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out


def problem(file: str, at: Position, path: PathKey, message: str) -> SpecError:
    """One positioned problem."""
    return SpecError(message, file=file, line=at[0], col=at[1], field=format_path(path) or None)


MAX_PROBLEMS = 50
"""Problems listed for one spec; the rest are counted."""


def collect(problems: list[SpecError], file: str) -> SpecError:
    """The one error raised for a spec: carries every problem (at most MAX_PROBLEMS, then a
    count of the others), sorted by position."""
    problems.sort(key=lambda p: (p.line or 0, p.col or 0))
    total = len(problems)
    if total > MAX_PROBLEMS:
        rest = problems[MAX_PROBLEMS]
        problems = problems[:MAX_PROBLEMS] + [SpecError(
            f"... and {total - MAX_PROBLEMS} more problems", file=file, line=rest.line,
            col=rest.col)]
    first = problems[0]
    noun = "problem" if total == 1 else "problems"
    return SpecError(f"{total} {noun} in {file}", file=file, line=first.line,
                     col=first.col, field=first.field, problems=problems)


def _line_col(text: str, index: int) -> Position:
    line_start = text.rfind("\n", 0, index) + 1
    return text.count("\n", 0, index) + 1, index - line_start + 1


def yaml_problem(exc: yaml.YAMLError, file: str, text: str = "") -> SpecError:
    """A YAML syntax error (or a refused document) at the line/column PyYAML reports."""
    if isinstance(exc, ReaderError) and isinstance(exc.character, int):
        message = (f"invalid YAML: character U+{exc.character:04X} is not allowed "
                   "(control characters have no place in a spec)")
        return problem(file, _line_col(text, exc.position), (), message)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    parts = [getattr(exc, "context", None), getattr(exc, "problem", None) or str(exc)]
    prefix = "" if isinstance(exc, SpecTooLarge) else "invalid YAML: "
    message = prefix + ", ".join(p for p in parts if p)
    return problem(file, (mark.line + 1, mark.column + 1) if mark else (1, 1), (), message)


def _english(err: Any) -> str:
    kind, ctx, found = err["type"], err.get("ctx") or {}, describe(err.get("input"))
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, found {found}"
    if kind in _BOUNDS:
        limit = next(iter(ctx.values()))
        what = "a number" if isinstance(limit, float) else "an integer"
        return f"expected {what} {_BOUNDS[kind]} {limit:g}, found {found}"
    if kind == "literal_error":
        return f"expected one of {ctx['expected'].replace(' or ', ', ')}, found {found}"
    if kind in ("value_error", "assertion_error"):
        return str(ctx["error"])
    if kind == "invalid_key":
        return f"expected a string key, found {found}"
    if kind == "string_too_short":
        return f"expected a non-empty string, found {found}"
    return f"{err['msg']}; found {found}"


def _model_at(root: type[BaseModel], path: PathKey) -> type[BaseModel] | None:
    """The model class that validates the mapping at `path` (list indexes skipped)."""

    def first_model(tp: Any) -> type[BaseModel] | None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return tp
        return next((m for m in map(first_model, get_args(tp)) if m), None)

    model: type[BaseModel] | None = root
    for part in path:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        model = first_model(model.model_fields[part].annotation)
    return model


def _clean_loc(loc: tuple[Any, ...], data: Any) -> tuple[PathKey, bool]:
    """A pydantic loc as a data path (union/validator tags dropped), and whether it is a key."""
    path: list[Any] = []
    on_key = False
    for part in loc:
        if part == "[key]":
            on_key = True
            continue
        in_dict = isinstance(data, dict) and part in data
        in_list = isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data)
        if in_dict or in_list:
            data = data[part]
        elif isinstance(part, str) and _LOC_TAG_RE.fullmatch(part):
            continue
        else:
            data = None
        path.append(part)
    return tuple(path), on_key


def validation_problems(
    exc: ValidationError, located: Located, file: str, root: type[BaseModel]
) -> list[SpecError]:
    """One positioned `SpecError` per pydantic error (`root` is the model validated)."""
    out = []
    for err in exc.errors():
        path, on_key = _clean_loc(err["loc"], located.data)
        if err["type"] == _PROBLEMS:
            for sub, message in err["ctx"]["problems"]:
                out.append(problem(file, located.position((*path, *sub)), (*path, *sub), message))
        elif err["type"] == "missing":
            message = f"missing required key {path[-1]!r}"
            out.append(problem(file, located.position(path[:-1]), path, message))
        elif err["type"] == "extra_forbidden":
            model, key = _model_at(root, path[:-1]), str(path[-1])
            known = list(model.model_fields) if model else []
            close = difflib.get_close_matches(key[:64], known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            message = f"unknown key {describe(key)}; {hint}"
            out.append(problem(file, located.position(path, key=True), path, message))
        else:
            on_key = on_key or err["type"] == "invalid_key"
            out.append(problem(file, located.position(path, key=on_key), path, _english(err)))
    return out
