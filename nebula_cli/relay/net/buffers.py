"""Receive buffers that are used again once nothing holds them any more.

A link receives a round's chunks into new buffers each round; memory that is new to a process
costs a page fault and a zeroed page per 4 KiB. For a 256 MB model that was a third of a relay's
CPU per round, and on a virtual machine whose freed memory goes back to the host it doubled a
round's time after a few rounds (docs/benchmarks.md). :class:`BufferPool` hands out bytearrays
of an exact size and takes one back as soon as no other object refers to it: a chunk's buffer
is free again once its frame, the decoded views of it and the round's parts are gone.

"Nothing else refers to it" is read from the reference count (CPython: ``sys.getrefcount``).
A view of a bytearray (``memoryview``, ``torch.frombuffer``) holds a reference to it, so a
buffer still read anywhere is never handed out twice. One thread (the link's receiver) calls
:meth:`BufferPool.get`; the others only drop their references.
"""

from __future__ import annotations

import sys
import sysconfig

POOLING = (sys.implementation.name == "cpython"
           and not sysconfig.get_config_var("Py_GIL_DISABLED"))
"""Reference counts say reliably who holds an object (CPython with its GIL); elsewhere the
pools hand out new memory every time."""
MIN_POOLED = 64 << 10
"""Buffers smaller than this are allocated each time (a page fault is not worth saving)."""
MAX_POOLED = 16
"""Buffers a pool keeps track of: a round's chunks in flight at once on one link (the
averaging thread consumes them as they arrive), not the whole model. They stay allocated
while the link lives (64 MiB with the default 4 MiB chunks)."""

_FREE_REFS = 2  # the pool's own list, and getrefcount's argument


class BufferPool:
    """Bytearrays of exact sizes, each handed out again once only the pool holds it."""

    def __init__(self, max_buffers: int = MAX_POOLED, min_bytes: int = MIN_POOLED) -> None:
        self.max_buffers = max_buffers
        self.min_bytes = min_bytes
        self._buffers: list[bytearray] = []
        self.reused = 0
        """Buffers handed out again (for tests and the benchmark)."""

    def get(self, nbytes: int) -> bytearray:
        """A bytearray of ``nbytes`` (its bytes are whatever was received last into it)."""
        if nbytes < self.min_bytes or not POOLING:
            return bytearray(nbytes)
        other = -1
        for i in range(len(self._buffers)):
            if sys.getrefcount(self._buffers[i]) > _FREE_REFS:
                continue
            if len(self._buffers[i]) == nbytes:
                self.reused += 1
                return self._buffers[i]
            other = i
        buf = bytearray(nbytes)
        if len(self._buffers) < self.max_buffers:
            self._buffers.append(buf)
        elif other >= 0:  # a free buffer of another size (the codec changed) makes room
            self._buffers[other] = buf
        return buf

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers the pool keeps (free or in use)."""
        return sum(len(b) for b in self._buffers)
