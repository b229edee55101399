"""Unix socket files only this user reaches: in a 0700 directory of the user's, mode 0600, the
peer's uid read from the kernel (SO_PEERCRED); a long path bound and reached through its
directory's /proc/self/fd entry (sun_path holds 108 bytes). Used by the keeper of a Slurm node
and by the SSH tunnels' local ends. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from collections.abc import Iterator

SHORT_PATH = 100
"""Longer socket paths are bound through /proc/self/fd (sun_path holds 108 bytes)."""


def private_dir(path: str, make: bool) -> None:
    """`path` is a directory of this user's that no one else may enter (made 0700 when `make`
    and missing, with its missing parents); OSError naming what is wrong otherwise."""
    if make and not os.path.isdir(path):
        if not os.path.isdir(parent := os.path.dirname(path)):
            private_dir(parent, make=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{path} is not a directory of uid {os.getuid()} (a link, or another "
                      "user's): remove it")
    if st.st_mode & 0o077:
        if not make:
            raise OSError(f"{path} is open to other users (mode {st.st_mode & 0o777:o})")
        os.chmod(path, 0o700)


def _peer_creds(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (from the kernel)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end (from the kernel)."""
    return _peer_creds(sock)[1]


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end (from the kernel)."""
    return _peer_creds(sock)[0]


@contextlib.contextmanager
def bindable(path: str) -> Iterator[str]:
    """A name bind/connect accept for `path` (its directory through /proc/self/fd if long)."""
    if len(os.fsencode(path)) <= SHORT_PATH:
        yield path
        return
    head, tail = os.path.split(path)
    fd = os.open(head, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{tail}"
    finally:
        os.close(fd)


def listen(path: str, role: str, hint: str = "") -> socket.socket:
    """A listening socket at `path` (0600, its directory made 0700 if missing; a socket file a
    killed process left there is replaced; one a live process serves, or anything else,
    refused: the error names `role`, what serves it, and its pid, with `hint`)."""
    private_dir(os.path.dirname(path), make=True)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket: remove it")
        if (pid := _answers(path)) is not None:
            raise OSError(f"another {role} serves {path} (pid {pid}" + (f": {hint})" if hint
                                                                        else ")"))
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with bindable(path) as where:
            server.bind(where)
        os.chmod(path, 0o600)
        server.listen(64)
    except BaseException:
        server.close()
        raise
    return server


def _answers(path: str) -> int | None:
    """The pid of the process that listens on the socket file at `path` (None: none does)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(5)
    try:
        with bindable(path) as where:
            probe.connect(where)
        return peer_pid(probe)
    except OSError:
        return None
    finally:
        probe.close()


def unlink_own(path: str, inode: int) -> None:
    """Remove the socket file at `path` if it is still the one bound as `inode` (another process
    may have replaced a file it took for a dead one's)."""
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == inode:
            os.unlink(path)
