"""Lines of an authorized_keys file added and taken away, safely beside whatever else is there.

A file is rewritten whole (a new temporary file in its directory, made with mkstemp: O_EXCL,
never through a symlink; fsynced, renamed over it) under an exclusive lock, so that two jobs
(or a job and `nebula stop`) editing one file never lose each other's lines. The lock is
``flock`` on a lock file beside it (``.<name>.nebula-lock``, 0600, opened read-write): on NFS
homes flock is a byte-range lock, which needs a descriptor open for writing (a read-only
descriptor of the directory fails there). The holder removes the lock file before it lets go;
whoever then holds a lock on a file no longer at that path opens it again (the lock that counts
is the one on the file the path names), so nothing is left beside authorized_keys. Lines of
tools that do not take the lock (``ssh-copy-id`` appends) are not lost either: the file is read
again right before the rename and the change made again on what it holds then (the window left
is the rename itself). Its mode is kept (0600, in a 0700 directory, when nebula makes it). A
symlinked file is edited where it points. Lines are told apart by their comment (the last
field): nebula's end with a tag naming the job and the tunnel. Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700
LOCK_SUFFIX = ".nebula-lock"
ATTEMPTS = 20
"""Times an edit is made again because another tool changed the file meanwhile."""


def resolve(path: str) -> Path:
    """The file `path` names on this host: ~, and sshd_config's %h (home), %u (user) and %%
    expanded; symlinks followed."""
    home = os.path.expanduser("~")
    tokens = {"%%": "%", "%h": home, "%u": pwd.getpwuid(os.getuid()).pw_name}
    path = re.sub(r"%[%hu]", lambda m: tokens[m.group()], path)
    return Path(os.path.realpath(os.path.expanduser(path)))


def comment(line: str) -> str:
    """The last field of a key line (nebula's tag on its own lines)."""
    fields = line.split()
    return fields[-1] if fields else ""


def lock_file(target: Path) -> Path:
    """The lock file of `target` (beside it, while an edit holds it)."""
    return target.with_name(f".{target.name}{LOCK_SUFFIX}")


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    lock = lock_file(target)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                now = os.stat(lock, follow_symlinks=False)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # its holder removed it meanwhile: lock the one there now
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)  # before the lock is let go: see _locked's loop
        os.close(fd)  # closing releases the lock


def _read(target: Path) -> tuple[str, int] | None:
    """The file's text and mode, or None when it does not exist."""
    try:
        return target.read_text(), target.stat().st_mode & 0o777
    except FileNotFoundError:
        return None


def _write_beside(target: Path, text: str, mode: int) -> str:
    """A new temporary file beside `target` holding `text`, with `mode`; its path."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.nebula-")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fchmod(fh.fileno(), mode)  # exactly `mode` (not narrowed by the umask)
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def edit(path: str, change: Callable[[list[str]], list[str]], *, make: bool) -> bool:
    """Rewrite the file's lines as `change` returns them; whether it changed. A file that
    does not exist is made only when `make`. `change` may be called more than once (when
    another tool changed the file meanwhile, on what it holds then)."""
    target = resolve(path)
    if not target.parent.is_dir():
        if not make:
            return False
        target.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    with _locked(target):
        seen = _read(target)
        for _ in range(ATTEMPTS):
            if seen is None and not make:
                return False
            text, mode = seen if seen is not None else ("", FILE_MODE)
            lines = text.splitlines()
            new = change(lines)
            if new == lines:
                return False
            tmp = _write_beside(target, "".join(f"{line}\n" for line in new), mode)
            now = _read(target)  # right before the rename: what another tool added meanwhile
            if now == seen:
                try:
                    os.replace(tmp, target)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                return True
            os.unlink(tmp)
            seen = now
    raise OSError(f"{target} kept changing while nebula edited it ({ATTEMPTS} tries)")


def add_lines(path: str, lines: Sequence[str]) -> bool:
    """Add key lines, each in place of a line with the same comment, else at the end."""
    def change(old: list[str]) -> list[str]:
        new = {comment(line): line for line in lines}
        out = [new.pop(comment(line), line) for line in old]
        return out + list(new.values())

    return edit(path, change, make=True)


def remove_tagged(path: str, tags: Sequence[str] = (), prefix: str | None = None) -> bool:
    """Remove the lines whose comment is one of `tags` or starts with `prefix`."""
    wanted = set(tags)
    return edit(path, lambda old: [line for line in old if comment(line) not in wanted and not (
        prefix is not None and comment(line).startswith(prefix))], make=False)
