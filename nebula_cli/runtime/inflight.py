"""Overlap's round in flight: rank 0 runs the round's exchange in a background thread while the
cluster trains on; every rank keeps which round is in flight, and rank 0 when its average
arrived (how long after the boundary: what the relays agree the merge step from)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nebula_cli.runtime.outer import SyncError


@dataclass
class FlightEnd:
    """What the round in flight ended with (rank 0's result or error; None elsewhere)."""

    round_id: int
    result: Any
    error: BaseException | None
    arrive_s: float | None
    """Rank 0: seconds from the round's start until its result arrived (None: it failed, or
    another rank)."""


class InFlight:
    """At most one overlapped round in flight."""

    def __init__(self) -> None:
        self.round_id: int | None = None
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._box: dict[str, Any] = {}

    @property
    def active(self) -> bool:
        return self.round_id is not None

    def start(self, round_id: int, call: Callable[[], Any] | None) -> None:
        """Round ``round_id`` is in flight; ``call`` (rank 0 only) runs its exchange."""
        self.round_id, self._t0 = round_id, time.perf_counter()
        box: dict[str, Any] = {"result": None, "error": None}
        self._box = box
        if call is None:
            return

        def run() -> None:
            try:
                box["result"] = call()
                box["arrived"] = time.perf_counter()
            except Exception as exc:
                box["error"] = exc

        self._thread = threading.Thread(target=run, name=f"nebula-outer-{round_id}", daemon=True)
        self._thread.start()

    def finish(self, wait: float) -> FlightEnd:
        """Wait (up to ``wait`` s) for the round in flight; nothing is in flight afterwards."""
        if self.round_id is None:  # pragma: no cover - callers check
            raise SyncError("no outer round in flight")
        round_id, box, self.round_id = self.round_id, self._box, None
        if self._thread is not None:
            self._thread.join(timeout=wait)
            if self._thread.is_alive():
                box["error"] = SyncError(f"outer round {round_id}: no result after {wait:.0f} s")
            self._thread = None
        arrived = box.get("arrived")
        return FlightEnd(round_id, box["result"], box["error"],
                       None if arrived is None or box["error"] else arrived - self._t0)

    def join(self, timeout: float) -> None:
        """Wait (bounded) for an exchange still running (closing)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)
