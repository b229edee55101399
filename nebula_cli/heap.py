"""Give the heap memory a process has freed back to the operating system.

glibc keeps what a process frees in its arenas (one per thread that allocated, up to eight per
core) for the process to use again. A relay and a worker's outer rounds allocate tensors of
the model's size on several threads (the links, the encoder, an overlapped round), and what
they free stays resident: 8 threads that made and freed 30 MB tensors left 8.6 GB resident, 233
MB after one trim; two relays and their workers on loopback held 65 MB more, and wandered
twice as far from sample to sample, without trims (measured 2026-11-29, issue 30). Over a
month's run that reads as growth, and it takes memory from a gateway host for nothing.

:class:`HeapTrim` asks glibc to return it (``malloc_trim(0)``: a few ms when there is little to
return), at most once per ``every`` seconds; it does nothing where the C library has no
``malloc_trim`` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

TRIM_EVERY_S = 10.0
"""The shortest time between two trims of one process."""


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (AttributeError, OSError, TypeError):  # no such function; no C library to open
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrim:
    """``trim()`` after a round: gives freed memory back unless that was done less than
    ``every`` seconds ago (or another thread is doing it now)."""

    def __init__(self, every: float = TRIM_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.clock = every, clock
        self._fn = _malloc_trim()
        self._last: float | None = None
        self._lock = threading.Lock()
        self.trims = 0
        """Trims made so far."""

    @property
    def supported(self) -> bool:
        return self._fn is not None

    def trim(self) -> bool:
        """Whether a trim ran now (not: too soon after the last, another thread's running,
        no ``malloc_trim`` here)."""
        if self._fn is None or not self._lock.acquire(blocking=False):
            return False
        try:
            now = self.clock()
            if self._last is not None and now - self._last < self.every:
                return False
            self._last = now
            self.trims += 1
            self._fn(0)  # 1 if memory was given back, 0 if there was none to give
            return True
        finally:
            self._lock.release()
