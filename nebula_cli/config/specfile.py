"""Reading the files a spec consists of, with bounds: the spec itself and the JSON it names.

A spec may come from anywhere, and so may the paths written in it (`deepspeed:`,
`placement:`). Every read here is bounded in size, refuses what is not a regular file (a FIFO
would block, `/dev/zero` never ends) and turns bad bytes into an error that says where they are.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_SPEC_BYTES = 256 * 1024
"""Largest spec file accepted (a spec with thousands of hosts takes a few tens of KiB)."""
MAX_JSON_BYTES = 4 * 1024 * 1024
"""Largest JSON file a spec may name (DeepSpeed config, placement)."""


class FileProblem(ValueError):
    """A file that cannot be used; `line`/`col` say where in it, when known."""

    def __init__(self, message: str, line: int | None = None, col: int | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.col = col


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; FileProblem otherwise.

    `what` names the file in messages ("spec", "DeepSpeed config /x/ds.json")."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise FileProblem(f"cannot read the {what}: no such file") from exc
    except (OSError, ValueError) as exc:
        raise FileProblem(f"cannot read the {what}: {_reason(exc)}") from exc
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise FileProblem(f"cannot read the {what}: it is a directory, expected a file")
        if not stat.S_ISREG(info.st_mode):
            raise FileProblem(f"cannot read the {what}: it is not a regular file (a pipe, "
                              "socket or device); save it to a file")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise FileProblem(f"cannot read the {what}: {_reason(exc)}") from exc
    finally:
        os.close(fd)
    if size > limit:
        raise FileProblem(f"the {what} is larger than {_size(limit)} ({_size(info.st_size)}); "
                          f"nebula reads no {what} that large")
    return b"".join(chunks)


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def decode_utf8(data: bytes, what: str) -> str:
    """`data` as text; a FileProblem at the line and column of the first undecodable byte."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise FileProblem(f"the {what} is UTF-16; save it as UTF-8", 1, 1)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        start = exc.start
        line = data.count(b"\n", 0, start) + 1
        line_start = data.rfind(b"\n", 0, start) + 1
        col = len(data[line_start:start].decode("utf-8", errors="replace")) + 1
        raise FileProblem(f"the {what} is not valid UTF-8: byte 0x{data[start]:02x} cannot "
                          "start or continue a character here; save the file as UTF-8",
                          line, col) from exc


def read_json(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse a small JSON file; FileProblem (never another exception) when it cannot be."""
    text = decode_utf8(read_bounded(path, limit, what), what)
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise FileProblem(f"the {what} is nested too deeply") from exc
    except ValueError as exc:
        raise FileProblem(f"the {what} is not valid JSON: {exc}") from exc
