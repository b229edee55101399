"""Collective tensors kept alive until the backend's threads have let go of them.

A gloo collective runs on one of the process group's C++ worker threads; the work object,
which holds the tensors, is released by that thread just after the caller's wait returns. When
the caller has already dropped its tensor, that release frees the tensor's Python object and so
takes the GIL. If the interpreter is finalizing by then (the script returned right after
training), the thread is torn down inside C++ code and the process aborts ("terminate called
without an active exception", exit 134) although training ended well. The NCCL watchdog
releases its work the same way. Seen on a restarted two-rank cluster under CPU contention.

So nebula's own collectives register their tensors with :func:`keep`, and the end of training
calls :func:`settle`: it waits (bounded) until only Python holds each tensor, then drops them,
in the main thread, with the GIL. ``Tensor._use_count()`` is the tensor's C++ reference count:
the Python object holds one, a collective's work another; Python names for the same object do
not count. A tensor the backend has let go of is dropped from the list at the next
:func:`keep` and by :func:`release`, which the runtime calls once a round's outcome is applied:
from then on only the caller's names hold it, and the last of them goes in the caller's thread.
So no rank keeps a round's average (a copy of the synced vector) past its round, and a tensor
the backend still holds stays listed until it lets go.

The script's own collectives (a Trainer's evaluate() after train(), a plain torch.distributed
loop) leave the same race behind when the script returns without destroying its process group,
as most do: two gloo ranks that all_gather 50 times and return aborted at exit in 24 of 60
runs on this 2-core machine under CPU load. :func:`release_default_group`, run by the runtime
hook at exit, destroys the group the script left: torch joins the backend's threads, without
the GIL, while the interpreter still runs (0 of 60 aborted).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

SETTLE_S = 10.0

_kept: list[torch.Tensor] = []


def _released(t: torch.Tensor) -> bool:
    return t._use_count() <= 1


def keep(tensor: torch.Tensor) -> torch.Tensor:
    """Hold `tensor` (just given to a collective) until settle(); returns it."""
    release()
    _kept.append(tensor)
    return tensor


def release() -> int:
    """Drop the kept tensors the backend has let go of (in this thread); returns how many are
    still held by it."""
    global _kept
    _kept = [t for t in _kept if not _released(t)]
    return len(_kept)


def settle(timeout: float = SETTLE_S) -> bool:
    """Wait until the backend released every kept tensor, then drop them all. False when some
    were still held after `timeout` (they are dropped anyway)."""
    global _kept
    deadline = time.monotonic() + timeout
    while any(not _released(t) for t in _kept) and time.monotonic() < deadline:
        time.sleep(0.001)
    done = all(_released(t) for t in _kept)
    _kept = []
    return done


def release_default_group() -> bool:
    """Destroy the default process group if the script left it initialized (at exit, before the
    interpreter finalizes). True when there was one to destroy."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.destroy_process_group()
    return True
