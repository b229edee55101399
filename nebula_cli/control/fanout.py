"""Run one function for many hosts at once; collect every outcome, raise once after all finish.

`fanout` never returns while one of its calls still runs: on a timeout, or when the waiting
thread is interrupted (Ctrl-C), it calls `cancel` (which must make the calls in flight return,
e.g. by aborting their connections), stops starting new calls, and waits for those in flight.
At most `max_workers` threads, all daemon threads: none can keep the process alive after the
command is done.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from nebula_cli.errors import NebulaError

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")

CANCEL_EVERY = 5.0
"""Seconds between calls of `cancel` while calls in flight have not returned yet."""


class GroupError(NebulaError):
    """Some hosts failed. `results` maps every key to its result or its exception."""

    def __init__(self, results: dict[object, object]) -> None:
        self.results = results
        self.failures = {k: v for k, v in results.items() if isinstance(v, BaseException)}
        lines = [f"{k}: {v}" for k, v in self.failures.items()]
        super().__init__(f"{len(self.failures)} of {len(results)} failed:\n  " + "\n  ".join(lines))


class _Calls:
    """The calls of one fanout, run by `workers` daemon threads taking keys from a queue."""

    def __init__(self, keys: list[K], fn: Callable[[K], R], workers: int) -> None:
        self.results: dict[object, object] = {}
        self.lock = threading.Lock()
        self._todo: queue.SimpleQueue[K] = queue.SimpleQueue()
        for k in keys:
            self._todo.put(k)
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(fn,), daemon=True,
                                          name="fanout") for _ in range(workers)]
        for t in self._threads:
            t.start()

    def _work(self, fn: Callable[[K], R]) -> None:
        while not self._stopped.is_set():
            try:
                key = self._todo.get_nowait()
            except queue.Empty:
                return
            outcome: object
            try:
                outcome = fn(key)
            except BaseException as exc:  # noqa: BLE001 - every outcome is reported
                outcome = exc
            with self.lock:
                self.results[key] = outcome

    def wait(self, timeout: float) -> bool:
        """Whether every thread has ended within `timeout` seconds."""
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(end - time.monotonic(), 0.0))
        return not any(t.is_alive() for t in self._threads)

    def stop(self) -> None:
        """Calls not yet started will not start."""
        self._stopped.set()


def fanout(
    keys: Iterable[K], fn: Callable[[K], R], *, timeout: float,
    cancel: Callable[[], None], max_workers: int = 32,
) -> dict[K, R]:
    """fn(key) for every key in parallel threads. Returns {key: result} when all succeeded;
    raises GroupError (with every key's outcome) when any failed or did not finish in time.
    On a timeout or an interrupt, `cancel()` is called (again every CANCEL_EVERY seconds) until
    the calls in flight have returned; an interrupt is then raised again."""
    keys = list(keys)
    if not keys:
        return {}
    calls = _Calls(keys, fn, min(max_workers, len(keys)))
    try:
        finished = _wait_all(calls, timeout)
    except BaseException:
        _cancel(calls, cancel)
        raise
    if not finished:
        _cancel(calls, cancel)
    with calls.lock:
        results = dict(calls.results)
    for k in keys:
        results.setdefault(k, TimeoutError(f"did not finish within {timeout:g} s"))
    if any(isinstance(v, BaseException) for v in results.values()):
        raise GroupError({k: results[k] for k in keys})
    return {k: results[k] for k in keys}  # type: ignore[misc]


def _wait_all(calls: _Calls, timeout: float) -> bool:
    """Wait for the calls at most `timeout` seconds, in short joins (so Ctrl-C gets through)."""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        if calls.wait(min(left, 0.2)):
            return True
    return calls.wait(0)


def _cancel(calls: _Calls, cancel: Callable[[], None]) -> None:
    """Stop what has not started, cancel what runs, and wait until it has returned."""
    calls.stop()
    while True:
        cancel()
        if calls.wait(CANCEL_EVERY):
            return
