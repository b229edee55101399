"""`in_netns(ns)`: the calling thread inside a named network namespace (`ip netns add`'s
/var/run/netns/NS) for the block, through setns(2). A network namespace is a thread's own: the
sockets the thread opens, and the threads and processes it starts, live there (the
distillation bench puts a teacher's serving thread on one test-bed host and the student on
another; `ip netns exec` would need a process for each)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into {what}: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(ns: str | None) -> Iterator[None]:
    """The calling thread in namespace ``ns`` until the block ends (None: where it is)."""
    if ns is None:
        yield
        return
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)  # this thread's own
    there = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(there, ns)
        try:
            yield
        finally:
            _setns(home, "the thread's own namespace")
    finally:
        os.close(there)
        os.close(home)
