"""The checkpoint staging directory of one host's ranks in /dev/shm: made private, named so
that no other user can find it, and recorded where only the job's user can read it.

`/dev/shm` is shared by every user of a node (GPU nodes often are). A directory there whose
name another user can compute could be made first by that user, filled with a ``step<N>``
symlink, or simply read: the staged model and optimizer would be theirs to read or replace,
and a replaced checkpoint runs code when DeepSpeed loads it (pickle). So the staging directory:

- is made by this host's writing rank (local rank 0) with ``mkdir(mode=0o700)`` under a name
  with 128 random bits (``nebula-ckpt-<32 hex digits>``); an existing path is refused, never
  reused, and the new directory is checked with ``lstat`` (a directory, no symlink, our uid,
  no access for group or others) before anything is written into it;
- is recorded in ``<agent dir>/checkpoint-staging`` (0600, in the agent's 0700 folder; the
  folder is named by ``NEBULA_AGENT_DIR``, which the agent sets for every process it runs): the
  other ranks of the host read it there and check it the same way before they write into it,
  and the agent removes what it names when the host's world has ended (before a restart, at the
  end, at `stop`); a restarted writer removes what an earlier process left and makes a new one;
- exists only for processes run by an agent: without ``NEBULA_AGENT_DIR`` checkpoints are
  staged on disk in ``<checkpoint dir>/.staging``.

Standard library only: the agent and the training runtime both use it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from nebula_cli.config.parts import SHM
from nebula_cli.errors import NebulaError

AGENT_DIR_ENV = "NEBULA_AGENT_DIR"
"""The environment variable that names the agent's folder to every process the agent runs."""
RECORD = "checkpoint-staging"
"""The file in the agent's folder that names the host's staging directory."""
PREFIX = "nebula-ckpt-"
NAME = re.compile(re.escape(PREFIX) + r"[0-9a-f]{32}")


class StagingError(NebulaError):
    """A staging directory (or its record) that is not private to the job's user."""


def agent_dir(env: dict[str, str] | None = None) -> Path | None:
    """The agent's folder of this process (None when no agent runs it)."""
    value = (os.environ if env is None else env).get(AGENT_DIR_ENV)
    return Path(value) if value else None


def check_private(path: Path, *, directory: bool) -> os.stat_result:
    """`path`'s lstat when it is ours: our uid, no symlink, of the expected kind, and no access
    for group or others; else StagingError saying what is wrong."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise StagingError(f"{path}: {exc.strerror}") from exc
    kind = "a directory" if directory else "a regular file"
    if stat.S_ISLNK(info.st_mode):
        raise StagingError(f"{path} is a symlink, not {kind}")
    if not (stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)):
        raise StagingError(f"{path} is not {kind}")
    if info.st_uid != os.getuid():
        raise StagingError(f"{path} belongs to uid {info.st_uid}, not to this user "
                           f"(uid {os.getuid()})")
    if info.st_mode & 0o077:
        raise StagingError(f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: other users "
                           "may use it (nebula makes it 0700)")
    return info


def create(agent: Path, shm: Path = SHM) -> Path:
    """Make a new private staging directory in `shm` and record it in `agent` (replacing the
    record). Raises OSError (the name exists, no room) or StagingError."""
    path = shm / f"{PREFIX}{secrets.token_hex(16)}"
    os.mkdir(path, 0o700)  # FileExistsError: never reuse what someone else made
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)  # a umask like 0277 took bits we need
        finally:
            os.close(fd)
        check_private(path, directory=True)
        _write_record(agent, path)
    except BaseException:
        with contextlib.suppress(OSError):
            path.rmdir()
        raise
    return path


def _write_record(agent: Path, path: Path) -> None:
    tmp = agent / f".{RECORD}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, f"{path}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, agent / RECORD)


def recorded(agent: Path, shm: Path = SHM) -> Path | None:
    """The staging directory `agent`'s record names (not checked: it may be gone), or None when
    there is no record. A record that is not ours, or names anything but a staging directory
    directly in `shm`, raises StagingError."""
    record = agent / RECORD
    if not os.path.lexists(record):
        return None
    check_private(record, directory=False)
    text = record.read_text().strip()
    path = Path(text)
    if path.parent != shm or not NAME.fullmatch(path.name):
        raise StagingError(f"{record} names {text!r}, not a staging directory in {shm}")
    return path


def open_recorded(agent: Path, shm: Path = SHM) -> Path:
    """The recorded staging directory, checked private (for a rank that writes into it)."""
    path = recorded(agent, shm)
    if path is None:
        raise StagingError(f"no checkpoint staging directory is recorded in {agent / RECORD}")
    check_private(path, directory=True)
    return path


def remove(agent: Path, shm: Path = SHM) -> Path | None:
    """Remove the recorded staging directory and its record (call only when no rank of the
    world is left, or from the writer before it makes a new one); the directory removed, or
    None. A recorded path that is not our private directory is left alone (its record goes)."""
    try:
        path = recorded(agent, shm)
    except (StagingError, OSError):
        path = None  # not a record of ours: dropped below, nothing it names is touched
    removed = None
    if path is not None and os.path.lexists(path):
        with contextlib.suppress(StagingError):
            check_private(path, directory=True)
            shutil.rmtree(path, ignore_errors=True)  # fd-based: never follows a symlink
            removed = path
        if removed is not None and os.path.lexists(path):
            return None  # not all of it went: the record keeps naming it for the next try
    with contextlib.suppress(FileNotFoundError):
        (agent / RECORD).unlink()
    return removed
