"""Run one function for many hosts at once; collect every outcome, raise once after all finish.

`fanout` never leaves work running behind it: on a timeout, or when the waiting thread is
interrupted (Ctrl-C), it calls `cancel` (which should make the calls in flight return, e.g. by
closing their connections) and waits for them. Its threads are daemon threads, so none can keep
the process alive after the command is done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from nebula_cli.errors import NebulaError

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")

CANCEL_WAIT = 5.0
"""Seconds fanout waits for the calls in flight after it cancelled them."""


class GroupError(NebulaError):
    """Some hosts failed. `results` maps every key to its result or its exception."""

    def __init__(self, results: dict[object, object]) -> None:
        self.results = results
        self.failures = {k: v for k, v in results.items() if isinstance(v, BaseException)}
        lines = [f"{k}: {v}" for k, v in self.failures.items()]
        super().__init__(f"{len(self.failures)} of {len(results)} failed:\n  " + "\n  ".join(lines))


class _Calls:
    """The calls of one fanout: at most `limit` at once, each in a daemon thread."""

    def __init__(self, keys: list[K], fn: Callable[[K], R], limit: int) -> None:
        self.results: dict[object, object] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(limit)
        self._done = threading.Event()
        self._left = len(keys)
        self._stopped = False
        self._threads = [threading.Thread(target=self._call, args=(k, fn), daemon=True,
                                          name=f"fanout-{k}") for k in keys]
        for t in self._threads:
            t.start()

    def _call(self, key: K, fn: Callable[[K], R]) -> None:
        outcome: object
        with self._slots:
            if self._stopped:
                outcome = TimeoutError("not started: the fan-out was cancelled")
            else:
                try:
                    outcome = fn(key)
                except BaseException as exc:  # noqa: BLE001 - every outcome is reported
                    outcome = exc
        with self._lock:
            self.results[key] = outcome
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(max(timeout, 0.0))

    def stop(self) -> None:
        """Calls not yet started will not start."""
        self._stopped = True

    def running(self) -> list[str]:
        return [t.name.removeprefix("fanout-") for t in self._threads if t.is_alive()]


def fanout(
    keys: Iterable[K], fn: Callable[[K], R], *, timeout: float, max_workers: int = 32,
    cancel: Callable[[], None] | None = None,
) -> dict[K, R]:
    """fn(key) for every key in parallel threads. Returns {key: result} when all succeeded;
    raises GroupError (with every key's outcome) when any failed or did not finish in time.
    On a timeout or an interrupt, `cancel()` is called and the calls in flight are waited for
    (at most CANCEL_WAIT seconds more); an interrupt is then raised again."""
    keys = list(keys)
    if not keys:
        return {}
    calls = _Calls(keys, fn, min(max_workers, len(keys)))
    try:
        finished = calls.wait(timeout)
    except BaseException:
        _cancel(calls, cancel)
        raise
    if not finished:
        _cancel(calls, cancel)
    with calls._lock:  # noqa: SLF001 - the results as of now
        results = dict(calls.results)
    for k in keys:
        results.setdefault(k, TimeoutError(f"did not finish within {timeout:g} s"))
    if any(isinstance(v, BaseException) for v in results.values()):
        raise GroupError({k: results[k] for k in keys})
    return {k: results[k] for k in keys}  # type: ignore[misc]


def _cancel(calls: _Calls, cancel: Callable[[], None] | None) -> None:
    """Stop what has not started, cancel what runs, and wait (bounded) for it to return."""
    calls.stop()
    if cancel is not None:
        cancel()
    deadline = time.monotonic() + CANCEL_WAIT
    while calls.running() and time.monotonic() < deadline:
        calls.wait(0.05)
