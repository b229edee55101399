"""Training metrics as JSON lines: written by workers, read back by the CLI.

``log(step=..., loss=...)`` appends one JSON object per call to the file named by
``NEBULA_METRICS_FILE`` (when set; rotated as ``$NEBULA_ROTATION`` says, `config.rotation`)
and prints the same object on stdout behind
``METRICS_TAG``, so a follower of plain logs can pick metrics out too. Every record
carries ``ts`` (unix time), ``step``, ``cluster``, ``host`` and ``rank`` from the worker's
environment. Floats that are not finite become ``null``.

``log`` is the training script's call and also notes that the script records metrics itself
(``script_logged``: the automatic hook then writes none of its own); nebula's own records go
through ``emit``, which writes the same way without that note.

Every record goes to the process's sinks (``Sink``: ``write(rec)``, ``close()``): ``JsonlSink``
always (the file and the tagged line above); in the process that writes its cluster's runs
(the plan names its ``metrics.json`` in ``$NEBULA_METRICS_CONFIG``), TensorBoard and W&B as the
spec's ``metrics:`` asks (``runtime.sinks``, loaded on the first record; a sink that fails is
named once in the log and dropped, training goes on).

``read_metrics(path, offset)`` reads complete records from a byte offset and returns the
offset to continue from, for tailing a file that is still being written.

This module imports only the standard library: the CLI uses it without torch.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from nebula_cli.config.parts import METRICS_CONFIG_ENV, METRICS_FILE_ENV
from nebula_cli.config.rotation import Rotation, append
from nebula_cli.errors import NebulaError

METRICS_TAG = "[nebula-metrics]"

DRY_RUN_ENV = "NEBULA_DRY_RUN"
"""Set by `nebula plan`'s dry run: OuterSync logs ``trainable_params`` and never syncs; the CLI
reads that record (here, beside the records' other names, so that it needs no torch)."""
RESERVED_KEYS = frozenset({"ts", "step", "cluster", "host", "rank"})

_lock = threading.Lock()
_script = {"calls": 0, "step": 0}  # the script's own `log` calls, and the last step it gave


class Sink(Protocol):
    """Where this process's records go."""

    def write(self, rec: Mapping[str, Any]) -> None:
        """One record (its values already JSON-able, as ``record`` made them)."""

    def close(self) -> None:
        """No more records (safe to call twice)."""


class JsonlSink:
    """``$NEBULA_METRICS_FILE`` (when set) and a tagged line on stdout: always on."""

    def write(self, rec: Mapping[str, Any]) -> None:
        line = format_record(rec)
        path = os.environ.get(METRICS_FILE_ENV)
        if path:
            # One write on an O_APPEND descriptor (whole lines); rotated as the agent says.
            append(path, (line + "\n").encode("utf-8"), Rotation.from_env())
        sys.stdout.write(f"{METRICS_TAG} {line}\n")
        sys.stdout.flush()

    def close(self) -> None:
        pass


class _Sinks:
    jsonl = JsonlSink()
    optional: list[Sink] | None = None  # opened on the first record


_sinks = _Sinks()


def sinks() -> list[Sink]:
    """This process's sinks: jsonl, then those its metrics.json asks for (opened once)."""
    if _sinks.optional is None:
        _sinks.optional = []
        config = os.environ.get(METRICS_CONFIG_ENV)
        if config:
            from nebula_cli.runtime.sinks import open_sinks

            _sinks.optional = open_sinks(config)
            if _sinks.optional:
                atexit.register(_close_optional)
                hook = sys.modules.get("nebula_cli.runtime.hook")
                if hook is not None:  # the end of training writes its last records first
                    hook.register_exit_again()
    return [_sinks.jsonl, *_sinks.optional]


def _close_optional() -> None:
    """At exit: close the optional sinks (a thread still writing gets a few seconds)."""
    held = _lock.acquire(timeout=5.0)
    try:
        optional, _sinks.optional = _sinks.optional or [], []
    finally:
        if held:
            _lock.release()
    for sink in optional:
        sink.close()


def _clean(value: Any) -> Any:
    """A JSON-able copy of ``value``: non-finite floats -> None, ``.item()`` scalars unwrapped."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    item = getattr(value, "item", None)  # numpy / torch scalars, without importing either
    if callable(item):
        try:
            return _clean(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def _env_rank() -> int | None:
    raw = os.environ.get("RANK")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def record(step: int, **values: Any) -> dict[str, Any]:
    """The record ``log`` would write, without writing it."""
    clash = RESERVED_KEYS.intersection(values)
    if clash:
        raise NebulaError(f"metric names {sorted(clash)} are reserved for the record's tags")
    rec: dict[str, Any] = {
        "ts": time.time(),
        "step": int(step),
        "cluster": os.environ.get("NEBULA_CLUSTER"),
        "host": os.environ.get("NEBULA_HOST"),
        "rank": _env_rank(),
    }
    rec.update({str(k): _clean(v) for k, v in values.items()})
    return rec


def format_record(rec: Mapping[str, Any]) -> str:
    """One record as a compact JSON line (no newline); strict JSON (no NaN/Infinity)."""
    return json.dumps(_clean(dict(rec)), separators=(",", ":"), allow_nan=False)


def log(step: int, **values: Any) -> dict[str, Any]:
    """Record metrics for ``step``: append to ``$NEBULA_METRICS_FILE`` and print a tagged line.

    Returns the record written. Values may be numbers, strings, bools, None, lists or dicts
    of those, or scalar objects with ``.item()`` (a 0-d tensor); anything else is ``str()``-ed.
    """
    rec = emit(step, **values)
    _script["calls"] += 1
    _script["step"] = rec["step"]
    return rec


def script_logged() -> tuple[int, int]:
    """How often this process's training script called ``log``, and the last step it gave."""
    return _script["calls"], _script["step"]


def emit(step: int, **values: Any) -> dict[str, Any]:
    """Write a record as ``log`` does, for nebula's own records (not counted as the script's)."""
    rec = record(step, **values)
    with _lock:
        for sink in sinks():
            sink.write(rec)
    return rec


def parse_line(line: str | bytes) -> dict[str, Any] | None:
    """A record from one JSON line or one tagged log line, or None if it is not one."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    text = line.strip()
    at = text.find(METRICS_TAG)
    if at >= 0:  # a tagged log line, possibly behind a log prefix
        text = text[at + len(METRICS_TAG) :].strip()
    if not text.startswith("{"):
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def read_metrics(path: str | os.PathLike[str], offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Records in complete lines of ``path`` from byte ``offset`` on, and the offset to go on from.

    A last line without its newline yet is left for the next call; malformed lines are
    skipped. A missing file gives ``([], offset)``; a file shorter than ``offset`` (it was
    replaced or truncated) is read again from the start.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if offset > size:
                offset = 0
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    records = []
    for raw in data[:end].split(b"\n"):
        rec = parse_line(raw) if raw.strip() else None
        if rec is not None:
            records.append(rec)
    return records, offset + end + 1
