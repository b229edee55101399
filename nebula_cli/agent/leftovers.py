"""What killed DeepSpeed processes leave on a host, found and removed by the agent.

Build locks
-----------
DeepSpeed compiles some ops (fused Adam, CPU Adam, the shared-memory comm op, ...) on first use
with ``torch.utils.cpp_extension.load``, which serialises builders with a ``FileBaton``: a file
``<build dir>/lock`` created with O_EXCL, kept open while the build runs, removed at the end.
A process killed while it builds (a stop, a restart, a preemption) leaves that file behind, and
every later process that needs the op waits for it to go away, forever and without a word
(``FileBaton.wait`` polls ``os.path.exists``). One stopped job would hang every job after it on
that host.

A lock is stale when no process holds it open: the builder keeps its descriptor open for the
whole build and closes it only just before removing the file. The agent removes stale locks
before it starts (or restarts) a host's processes, and says so in the host's events. Only
our own user's locks older than ``MIN_AGE_S`` are judged (a release in progress is never
raced; another user's holders are not visible to us).

Where torch puts build directories (``torch.utils.cpp_extension._get_build_directory``):
``$TORCH_EXTENSIONS_DIR/<op>/`` when set, else ``<user cache>/torch_extensions/<py>_<acc>/<op>/``
with the user cache ``$XDG_CACHE_HOME`` or ``~/.cache``. Linux only (``/proc``); elsewhere
nothing is judged stale.

Shared-memory buffers
---------------------
On CPU, DeepSpeed's comm op maps one ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_
<MASTER_PORT>_<rank>`` (about 70 MB) per rank when every rank of the world is on one host
(``LOCAL_SIZE`` = world size) and never unlinks it: every run leaks them, and a restarted
world on the same address and port would map the killed run's buffers. The agent removes its
group's buffers once no process of the group is left, before a restart and at the end; with
them the host's checkpoint staging directory in /dev/shm, which a killed save leaves full (its
random name is recorded in the agent's folder: `nebula_cli.config.staging`; only a private
directory of our own is removed).

DeepSpeed opens those buffers with ``O_CREAT`` but without ``O_EXCL``, and opens the other
ranks' by name: one that another user made first at such a name (/dev/shm is writable by all)
would carry the world's tensors through a file that user can read and write. The agent never
removes or uses one that is not ours: it refuses to start the world, naming the file and its
owner (`SharedMemoryTaken`).

Standard library only, as the rest of the agent.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from pathlib import Path

from nebula_cli.config import staging
from nebula_cli.config.parts import SHM
from nebula_cli.errors import NebulaError

MIN_AGE_S = 5.0
LOCK_NAME = "lock"
SHM_PREFIX = "deepspeed_allreduce_buffer"


def lock_files(env: Mapping[str, str]) -> list[Path]:
    """Every build lock present under the roots `env` (a worker's environment) builds in."""
    found: list[Path] = []
    explicit = env.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        found += Path(explicit).expanduser().glob(f"*/{LOCK_NAME}")
    cache = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or "~").expanduser() / ".cache")
    found += (Path(cache).expanduser() / "torch_extensions").glob(f"*/*/{LOCK_NAME}")
    return sorted(set(found))


def open_files() -> set[str]:
    """Paths that some process we may look at holds open (empty when /proc is not there)."""
    held: set[str] = set()
    proc = Path("/proc")
    if not proc.is_dir():
        return held
    for fd_dir in proc.glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    held.add(os.readlink(fd))
    return held


def stale_locks(env: Mapping[str, str], now: float | None = None) -> list[Path]:
    """Locks no process holds open and older than MIN_AGE_S."""
    if not Path("/proc/self/fd").is_dir():
        return []
    now = time.time() if now is None else now
    candidates = []
    for path in lock_files(env):
        with contextlib.suppress(OSError):
            info = path.stat()  # another user's lock is held by processes we cannot see
            if info.st_uid == os.getuid() and now - info.st_mtime >= MIN_AGE_S:
                candidates.append(path)
    if not candidates:
        return []
    held = open_files()
    return [p for p in candidates if str(p.resolve()) not in held and str(p) not in held]


def remove_stale_locks(env: Mapping[str, str]) -> list[Path]:
    """Remove the stale locks; returns the ones removed."""
    return _unlink(stale_locks(env))


def _unlink(paths: list[Path]) -> list[Path]:
    """Remove the files; the ones that were still there."""
    removed = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def shm_buffers(env: Mapping[str, str]) -> list[Path]:
    """The DeepSpeed shared-memory buffers of the world whose ranks run with `env`."""
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port or not SHM.is_dir():
        return []
    return sorted(SHM.glob(f"{SHM_PREFIX}_{os.getuid()}_{addr}_{port}_*"))


def _owner(path: Path) -> int | None:
    try:
        return os.lstat(path).st_uid
    except FileNotFoundError:
        return None


def remove_shm_buffers(env: Mapping[str, str]) -> list[Path]:
    """Remove ours (call only when no process of that world is left); the ones removed."""
    return _unlink([p for p in shm_buffers(env) if _owner(p) == os.getuid()])


class SharedMemoryTaken(NebulaError):
    """Another user made a buffer of the world's in /dev/shm: the world is not started."""


def check_shm_buffers(env: Mapping[str, str]) -> None:
    """Raise SharedMemoryTaken when a buffer of the world whose ranks run with `env` exists
    and is not ours (a file or a link of another user's): DeepSpeed would open it."""
    taken = [(p, uid) for p in shm_buffers(env)
             if (uid := _owner(p)) is not None and uid != os.getuid()]
    if taken:
        path, uid = taken[0]
        raise SharedMemoryTaken(
            f"{path} belongs to another user (uid {uid}): DeepSpeed opens it without "
            "O_EXCL and would share this world's tensors through it, so the world is not "
            f"started; have it removed (`rm {path}` as its owner or root), or launch again "
            "(another MASTER_PORT names other buffers)")


def clear_world(env: Mapping[str, str], agent_dir: Path) -> None:
    """What a world whose ranks ran with `env` under the agent of `agent_dir` left in /dev/shm:
    DeepSpeed's buffers and the host's checkpoint staging (call only when no process of that
    world is left)."""
    remove_shm_buffers(env)
    remove_checkpoint_staging(agent_dir)


def remove_checkpoint_staging(agent_dir: Path) -> Path | None:
    """Remove the checkpoint staging directory in /dev/shm recorded in `agent_dir` and its
    record (call only when no process of the world is left); the directory removed, or None."""
    return staging.remove(agent_dir)
