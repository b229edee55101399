"""File operations over exec channels, for hosts whose sshd has no SFTP subsystem.

Hardened HPC login nodes often disable SFTP. Then SSHTransport does what it did over SFTP with
POSIX sh, coreutils, ``base64`` and ``tar`` over exec channels instead: writes go to a temporary
name beside the target, get their mode (and mtime) and are renamed over it; reads come back in
base64 (an exec channel's output is text). Paths travel as positional arguments of ``sh -c``,
never spliced into the script. Every script runs under ``umask 077``: directories are made
0700 and a file is created 0600 (with noclobber: never an existing file) before its bytes are
written, then given its final mode.
"""

from __future__ import annotations

import base64
import io
import os
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from nebula_cli.errors import TransportError
from nebula_cli.transport import tree
from nebula_cli.transport.base import CommandResult

PRIVATE = "umask 077; "
"""Starts every script: what it makes is the user's alone until given its final mode."""
WRITE_SH = (PRIVATE + 'd=$(dirname "$1"); mkdir -p "$d" && t="$d/.$(basename "$1").$$.tmp" && '
            'rm -f "$t" && (set -C; cat > "$t") && chmod "$2" "$t" && '
            '{ [ -z "$3" ] || touch -d "@$3" "$t"; } && mv -f "$t" "$1" || { rm -f "$t"; exit 1; }')
READ_SH = ('[ -f "$1" ] || { echo missing; exit 0; }; s=$(wc -c < "$1"); o=$2; '
           '[ "$s" -lt "$o" ] && o=0; echo "$s $o"; '
           'tail -c +$((o + 1)) "$1" | head -c "$3" | base64')
LIST_SH = (PRIVATE + 'mkdir -p "$1" && cd "$1" && find . -type f -exec stat -c "%s %Y %n" {} +')
UNTAR_SH = PRIVATE + 'mkdir -p "$1" && tar -xpf - --no-same-owner -C "$1"'


class Runner(Protocol):
    name: str

    def run(self, argv: Sequence[str] | str, *, stdin: bytes | None = None,
            timeout: float = ...) -> CommandResult: ...


class ExecFiles:
    """The file half of a transport, over `runner.run` (absolute paths only)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def _sh(self, script: str, *args: str, stdin: bytes | None = None,
            what: str) -> CommandResult:
        result = self.runner.run(["sh", "-c", script, "sh", *args], stdin=stdin, timeout=600)
        if not result.ok:
            raise TransportError(f"cannot {what}: {result.stderr.strip() or result}",
                                 host=self.runner.name)
        return result

    def home(self) -> str:
        return self._sh("cd && pwd -P", what="find the remote home directory").stdout.strip()

    def write(self, data: bytes, path: str, mode: int, mtime: float | None = None) -> None:
        self._sh(WRITE_SH, path, f"{mode & 0o7777:o}", "" if mtime is None else str(int(mtime)),
                 stdin=data, what=f"write {path}")

    def put(self, local: str, path: str, mode: int | None) -> None:
        """A local file's bytes, with its own mode unless one is given."""
        try:
            data = Path(local).read_bytes()
            file_mode = mode if mode is not None else os.stat(local).st_mode & 0o7777
        except OSError as exc:
            raise TransportError(f"cannot copy {local} to {path}: {exc}",
                                 host=self.runner.name) from exc
        self.write(data, path, file_mode)

    def get(self, path: str, local: str) -> None:
        data, _ = self.read_tail(path, 0, max_bytes=1 << 62)
        if not data and not self.exists(path):
            raise TransportError(f"cannot copy {path} to {local}: no such file",
                                 host=self.runner.name)
        target = Path(local)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, target)
        except OSError as exc:
            raise TransportError(f"cannot copy {path} to {local}: {exc}",
                                 host=self.runner.name) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def read_tail(self, path: str, offset: int, max_bytes: int) -> tuple[bytes, int]:
        out = self._sh(READ_SH, path, str(offset), str(max_bytes), what=f"read {path}").stdout
        head, _, body = out.partition("\n")
        if head.strip() == "missing":
            return b"", offset
        start = int(head.split()[1])
        data = base64.b64decode(body)
        return data, start + len(data)

    def makedirs(self, path: str, mode: int) -> None:
        self._sh(PRIVATE + 'mkdir -p "$1" && chmod "$2" "$1"', path, f"{mode & 0o7777:o}",
                 what=f"make directory {path}")

    def exists(self, path: str) -> bool:
        return self.runner.run(["test", "-e", path], timeout=60).ok

    def upload_tree(self, local_dir: str, base: str, exclude: Sequence[str],
                    progress: Callable[[int, int], None] | None) -> tuple[int, int]:
        """Files whose copy there differs (size, whole-second mtime) go in one tar stream."""
        dirs, files = tree.walk(local_dir, exclude)
        listing = self._sh(LIST_SH, base, what=f"list {base}").stdout
        remote: dict[str, tuple[int, float]] = {}
        for line in listing.splitlines():
            size, mtime, rel = line.split(" ", 2)
            remote[rel.removeprefix("./")] = (int(size), float(mtime))
        todo = [f for f in files if not (f.rel in remote and tree.unchanged(f, *remote[f.rel]))]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for rel_dir in dirs:
                if rel_dir:
                    info = tarfile.TarInfo(rel_dir)
                    info.type, info.mode = tarfile.DIRTYPE, 0o700
                    tar.addfile(info)
            for item in todo:
                info = tar.gettarinfo(str(item.path), arcname=item.rel)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with open(item.path, "rb") as src:
                    tar.addfile(info, src)
        total = sum(item.size for item in todo)
        self._sh(UNTAR_SH, base, stdin=buf.getvalue(), what=f"upload {local_dir} to {base}")
        if progress is not None:
            progress(total, total)
        return len(todo), total
