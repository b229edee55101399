"""The newest metrics of an agent's processes, found with bounded work however long the run.

A metrics file (``metrics/rank0.jsonl``, ``metrics/relay.jsonl``) grows by one JSON line per
record for the whole run: a long job holds millions. `status` must not re-read it. This
module owns a small summary per file: the newest value of every metric (``latest``, newer
records overriding older ones, as the CLI merged them before) and the newest ``final``
record, plus the byte offset it has read to.

Each update reads at most `SCAN_BYTES`: from the stored offset when the file grew by less
than that since the last update, else only its last `SCAN_BYTES` (a metric logged only in the
skipped middle keeps its older value). The agent keeps the summaries of its files in
``<agent dir>/metrics-summary.json`` (`SUMMARY_FILE`); the `status` command answers with them.
The CLI uses the same `update` on bytes read over a transport when an agent cannot answer.

A rotated metrics file (`config.rotation`: renamed to ``<file>.1`` whole) is not a new file:
the summary finds the inode it was reading among the rotated files, reads the rest of it from
its offset, and goes on with the new live file keeping what it knew (`carry`). A file replaced
otherwise (its old inode not among the rotated ones) starts a new summary.

Standard library only: the agent runs on hosts with nothing but Python.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nebula_cli.config.rotation import rotated

SUMMARY_FILE = "metrics-summary.json"
SUMMARY_VERSION = 1
SCAN_BYTES = 256 << 10  # the most one update reads of one metrics file
MAX_VALUE_BYTES = 2048  # a value longer than this (as JSON) is left out of a summary
FINAL_CARRIES = ("step", "eval_loss")  # what a `final` record updates in `latest`

Reader = Callable[[int, int], bytes]  # (offset, length) -> bytes of the file


def new_state() -> dict[str, Any]:
    """The summary of a file not read yet."""
    return {"offset": 0, "ino": None, "latest": {}, "final": None, "read": 0}


def carry(state: dict[str, Any]) -> dict[str, Any]:
    """A summary of the next file of a rotated series: what `state` knew, read from 0."""
    return {**new_state(), "latest": state["latest"], "final": state["final"]}


def _small(record: dict[str, Any]) -> dict[str, Any]:
    """The record without values too long for a summary."""
    out = {}
    for key, value in record.items():
        if isinstance(value, (dict, list, str)) and len(json.dumps(value)) > MAX_VALUE_BYTES:
            continue
        out[key] = value
    return out


def merge_record(state: dict[str, Any], record: dict[str, Any]) -> None:
    """Fold one record (newer than everything folded before) into a summary."""
    record = _small(record)
    if record.get("final"):
        state["final"] = record
        state["latest"].update({k: record[k] for k in FINAL_CARRIES if k in record})
    else:
        state["latest"].update(record)


def merge_bytes(state: dict[str, Any], data: bytes, *, skip_first: bool) -> int:
    """Fold the complete lines of `data` into a summary; how many bytes of it were consumed
    (up to the end of the last complete line). skip_first drops a partial first line."""
    start = 0
    if skip_first:
        cut = data.find(b"\n")
        if cut < 0:
            return 0
        start = cut + 1
    end = data.rfind(b"\n") + 1
    if end <= start:
        return start
    for line in data[start:end].split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a corrupt line: the others still count
        if isinstance(record, dict):
            merge_record(state, record)
    return end


def update(state: dict[str, Any], read: Reader, size: int, ino: Any = None) -> dict[str, Any]:
    """The summary brought up to a file of `size` bytes, reading at most SCAN_BYTES of it.

    A file that shrank or was replaced (another inode) starts a new summary."""
    if size < state.get("offset", 0) or (ino is not None and state.get("ino") not in (None, ino)):
        state = new_state()
    state["ino"] = ino
    start = state["offset"]
    skip_first = False
    if size - start > SCAN_BYTES:
        start, skip_first = size - SCAN_BYTES, True
    data = read(start, size - start) if size > start else b""
    state["read"] = len(data)
    consumed = merge_bytes(state, data, skip_first=skip_first)
    if consumed or not skip_first:
        state["offset"] = start + consumed
    return state


def public(state: dict[str, Any], rel: str) -> dict[str, Any]:
    """What `status` returns for one file."""
    return {"file": rel, "latest": state["latest"], "final": state["final"],
            "offset": state["offset"], "read": state["read"]}


def metric_files(agent_dir: Path) -> dict[str, str]:
    """rank -> metrics path relative to the agent dir: the processes of agent.json that name
    one (keyed by the process's name: its rank, or "relay"), then any other
    ``metrics/*.jsonl`` (keyed by its stem)."""
    files: dict[str, str] = {}
    try:
        config = json.loads((agent_dir / "agent.json").read_text())
        for i, proc in enumerate(config.get("processes") or []):
            if isinstance(proc, dict) and isinstance(proc.get("metrics"), str):
                files[str(proc.get("name", proc.get("rank", i)))] = proc["metrics"]
    except (OSError, ValueError, AttributeError):
        pass
    known = set(files.values())
    for path in sorted((agent_dir / "metrics").glob("*.jsonl")):
        rel = f"metrics/{path.name}"
        if rel not in known:
            files.setdefault(path.stem.removeprefix("rank"), rel)
    return files


def _valid(state: Any) -> dict[str, Any]:
    """A stored summary as read back, or a new one when it is not a whole summary."""
    fresh = new_state()
    if not isinstance(state, dict) or not all(k in state for k in fresh):
        return fresh
    ok = (isinstance(state["offset"], int) and isinstance(state["latest"], dict)
          and isinstance(state["final"], (dict, type(None))))
    return state if ok else fresh


def _load(agent_dir: Path) -> dict[str, Any]:
    try:
        stored = json.loads((agent_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}
    ok = isinstance(stored, dict) and stored.get("version") == SUMMARY_VERSION
    return stored.get("files", {}) if ok and isinstance(stored.get("files"), dict) else {}


def _save(agent_dir: Path, files: dict[str, Any]) -> None:
    """Write the summaries atomically; a directory we cannot write only costs a re-read."""
    path = agent_dir / SUMMARY_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"version": SUMMARY_VERSION, "files": files}))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _reader(fh: Any) -> Reader:
    def read(offset: int, length: int) -> bytes:
        fh.seek(offset)
        return fh.read(length)

    return read


def _rotated_from(path: Path, ino: Any) -> Path | None:
    """The rotated file of `path` that is the inode `ino` (the file a summary was reading)."""
    n = 1
    while True:
        older = Path(rotated(path, n))
        try:
            if older.stat().st_ino == ino:
                return older
        except OSError:
            return None
        n += 1


def _finish_rotated(state: dict[str, Any], path: Path, ino: Any) -> dict[str, Any]:
    """`state` of a file that is no longer `path` (inode `ino` now): when it was rotated, its
    rest read from where the summary was and carried over to the new live file."""
    if state["ino"] in (None, ino):
        return state
    older = _rotated_from(path, state["ino"])
    if older is None:
        return state  # replaced, not rotated: `update` starts anew
    try:
        with open(older, "rb") as fh:
            st = os.fstat(fh.fileno())
            state = update(state, _reader(fh), st.st_size, st.st_ino)
    except OSError:
        pass
    return carry(state)


def summarize_dir(agent_dir: Path) -> dict[str, dict[str, Any]]:
    """rank -> summary of its metrics file, each brought up to date with bounded reads."""
    files = metric_files(agent_dir)
    if not files:
        return {}
    stored = _load(agent_dir)
    states: dict[str, Any] = {}
    out: dict[str, dict[str, Any]] = {}
    for rank, rel in files.items():
        path = agent_dir / rel
        try:
            with open(path, "rb") as fh:
                st = os.fstat(fh.fileno())
                state = _finish_rotated(_valid(stored.get(rel)), path, st.st_ino)
                state = update(state, _reader(fh), st.st_size, st.st_ino)
        except FileNotFoundError:
            continue
        except OSError:
            continue  # unreadable now; the next status call tries again
        states[rel] = state
        out[rank] = public(state, rel)
    if states:
        _save(agent_dir, states)
    return out


def attach(status: dict[str, Any], agent_dir: Path) -> dict[str, Any]:
    """An agent's status with its processes' newest metrics under ``metrics``."""
    if agent_dir.is_dir():
        status["metrics"] = summarize_dir(agent_dir)
    return status
