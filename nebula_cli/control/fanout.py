"""Run one function for many hosts at once; collect every outcome, raise once after all finish."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

from nebula_cli.errors import NebulaError

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


class GroupError(NebulaError):
    """Some hosts failed. `results` maps every key to its result or its exception."""

    def __init__(self, results: dict[object, object]) -> None:
        self.results = results
        self.failures = {k: v for k, v in results.items() if isinstance(v, BaseException)}
        lines = [f"{k}: {v}" for k, v in self.failures.items()]
        super().__init__(f"{len(self.failures)} of {len(results)} failed:\n  " + "\n  ".join(lines))


def fanout(
    keys: Iterable[K], fn: Callable[[K], R], *, timeout: float, max_workers: int = 32
) -> dict[K, R]:
    """fn(key) for every key in parallel threads. Returns {key: result} when all succeeded;
    raises GroupError (with every key's outcome) when any failed or did not finish in time."""
    keys = list(keys)
    if not keys:
        return {}
    results: dict[object, object] = {}
    pool = ThreadPoolExecutor(max_workers=min(max_workers, len(keys)))
    try:
        futures = {pool.submit(fn, k): k for k in keys}
        done, not_done = wait(futures, timeout=timeout)
        for fut in done:
            exc = fut.exception()
            results[futures[fut]] = exc if exc is not None else fut.result()
        for fut in not_done:
            fut.cancel()
            results[futures[fut]] = TimeoutError(f"did not finish within {timeout:g} s")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if any(isinstance(v, BaseException) for v in results.values()):
        raise GroupError({k: results[k] for k in keys})
    return {k: results[k] for k in keys}  # type: ignore[misc]
