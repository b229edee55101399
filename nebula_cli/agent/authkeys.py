"""Lines of an authorized_keys file added and taken away, safely beside whatever else is there.

A file is rewritten whole (a temporary file in its directory, fsynced, renamed over it) under
an exclusive lock on its directory, so that two jobs (or a job and `nebula stop`) editing one
file never lose each other's lines; its mode is kept (0600, in a 0700 directory, when nebula
makes it). A symlinked file is edited where it points. Lines are told apart by their comment
(the last field): nebula's end with a tag naming the job and the tunnel. Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


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


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def edit(path: str, change: Callable[[list[str]], list[str]], *, make: bool) -> bool:
    """Rewrite the file's lines as `change` returns them; whether it changed. A file that
    does not exist is made only when `make`."""
    target = resolve(path)
    if not target.parent.is_dir():
        if not make:
            return False
        target.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    with _locked(target.parent):
        try:
            text = target.read_text()
            mode = target.stat().st_mode & 0o777
        except FileNotFoundError:
            if not make:
                return False
            text, mode = "", FILE_MODE
        lines = text.splitlines()
        new = change(lines)
        if new == lines:
            return False
        tmp = target.with_name(f".{target.name}.nebula-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write("".join(f"{line}\n" for line in new))
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, mode)  # not narrowed by the umask
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return True


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
