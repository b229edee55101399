"""Size-bounded files that only grow by appends: logs and metrics records, rotated.

A long job's logs (``logs/rank0.log``, ``logs/relay.log``), records (``metrics/rank0.jsonl``,
``metrics/relay.jsonl``) and agent events (``events.jsonl``) would otherwise grow for as long as
it runs. Each is kept as its live file plus at most ``keep`` rotated ones, ``<file>.1`` (the
newest) to ``<file>.<keep>`` (the oldest): when an append would take the live file past
``max_bytes``, it is renamed to ``.1`` (``.1`` to ``.2``, ..., the oldest removed) and the append
starts a new live file. What one file holds is bounded by ``Rotation.bound``.

Rotation is by rename, done by the one writer of a file, so that nothing written is lost and a
record is never cut: a rotated file is the old live file whole, byte for byte. That is what
lets a reader that was at offset ``n`` of the live file go on at offset ``n`` of ``.1`` when the
live file turns out shorter than ``n`` (or another inode): `follow`, `summary`. Readers that
want everything read ``.<keep>`` ... ``.1`` and then the live file (`paths_oldest_first`).

The sizes come from the spec (``logs: {max_mb, keep}``; `config.sections.LogsSpec`); the agent
gets them in its ``agent.json`` (`AgentConfig.rotation`) and hands them to every process it
starts in ``$NEBULA_ROTATION`` (`ROTATION_ENV`), which a metrics writer (the runtime's
``JsonlSink``, the relay's status writer) reads.

Standard library only: the agent, the runtime and the relay all use it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

ROTATION_ENV = "NEBULA_ROTATION"
"""``<max_bytes>:<keep>``, set by the agent for every process it starts."""
LINE_SLACK = 64 << 10
"""A file may pass ``max_bytes`` by at most this much to end a line it holds the start of (a
rotated file ends at a line's end; a line longer than that is cut)."""


@dataclass(frozen=True)
class Rotation:
    """How one appended file is bounded (spec: logs)."""

    max_bytes: int
    """A live file is rotated before an append would take it past this size."""
    keep: int
    """Rotated files kept (``<file>.1`` .. ``<file>.<keep>``); older ones are removed."""

    def bound(self) -> int:
        """The most bytes the live file and its rotated ones hold together."""
        return (self.keep + 1) * (self.max_bytes + LINE_SLACK)

    def to_env(self) -> str:
        return f"{self.max_bytes}:{self.keep}"

    @classmethod
    def from_env(cls, value: str | None = None) -> Rotation | None:
        """The rotation named in ``$NEBULA_ROTATION`` (or `value`); None: not set or unusable
        (the file then grows unbounded, as before rotation existed)."""
        raw = os.environ.get(ROTATION_ENV) if value is None else value
        try:
            size, keep = (int(x) for x in (raw or "").split(":"))
        except ValueError:
            return None
        return cls(size, keep) if size > 0 and keep >= 0 else None


def rotated(path: str | os.PathLike[str], n: int) -> str:
    """The name of the n-th rotated file of `path` (1: the newest)."""
    return f"{os.fspath(path)}.{n}"


def paths_oldest_first(path: str, keep: int) -> list[str]:
    """Every file that may hold `path`'s records, oldest first, the live file last."""
    return [rotated(path, n) for n in range(keep, 0, -1)] + [path]


def rotate(path: str | os.PathLike[str], keep: int) -> None:
    """Shift `path` to ``.1`` (``.1`` to ``.2``, ...), the oldest beyond `keep` removed; with
    keep 0 the live file is removed. Missing files are skipped."""
    path = os.fspath(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(rotated(path, keep) if keep else path)
    for n in range(keep - 1, 0, -1):
        with contextlib.suppress(FileNotFoundError):
            os.replace(rotated(path, n), rotated(path, n + 1))
    if keep:
        with contextlib.suppress(FileNotFoundError):
            os.replace(path, rotated(path, 1))


def split_for(size: int, data: bytes, rotation: Rotation, ends_line: bool) -> int:
    """How many bytes of `data` still go to a live file of `size` bytes before it rotates:
    all of it when it fits; else its whole lines that fit. A file that is empty or ends
    within a line (`ends_line` False) first takes the rest of that line, up to LINE_SLACK
    past the size (a longer line is cut there). 0: rotate first."""
    limit = rotation.max_bytes
    if size + len(data) <= limit:
        return len(data)
    cut = data.rfind(b"\n", 0, max(limit - size, 0)) + 1
    if cut or (size and ends_line):
        return cut
    room = max(limit - size, 0) + LINE_SLACK
    end = data.find(b"\n", 0, room)
    return end + 1 if end >= 0 else min(len(data), room)


def append(path: str | os.PathLike[str], data: bytes, rotation: Rotation | None,
           mode: int = 0o644) -> None:
    """Append `data` (whole lines) to `path`, rotating first when it would grow too big.
    One writer per file (rotation is not locked against another writer)."""
    path = os.fspath(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    while data:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, mode)
        try:
            size = os.fstat(fd).st_size
            take = len(data) if rotation is None else split_for(
                size, data, rotation, size == 0 or os.pread(fd, 1, size - 1) == b"\n")
            if take:
                os.write(fd, data[:take])  # one write on O_APPEND: whole lines
        finally:
            os.close(fd)
        data = data[take:]
        if data and rotation is not None:
            rotate(path, rotation.keep)
