"""WAN emulation for a relay's peer links: a rate limit (token bucket) and a one-way delay.

netem does not exist on the kernels nebula is tested on, so the delay is applied in user space:
every frame is stamped when it is queued for a peer and not written before ``stamp + delay``.
Frames queued back to back are delayed together (the delay adds latency, not a gap between
frames), then the token bucket paces the bytes at the configured rate. Shaping is per direction:
each relay shapes what it sends, so a round trip between two shaped relays takes at least
twice the one-way delay. Used for local runs, demos and benchmarks; off unless configured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from nebula_cli.config.relay_config import ShapingConfig

MIN_BURST = 64 * 1024
"""Smallest bucket (bytes): large enough to keep syscalls few, small enough to pace finely."""


class TokenBucket:
    """A budget of ``rate`` bytes per second with at most ``burst`` bytes saved up."""

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = float(rate)
        self.burst = int(burst)
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Block until ``n`` bytes (at most ``burst``) may be sent, then spend them."""
        n = min(int(n), self.burst)
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)


class Shaper:
    """Rate and delay applied to one direction of one link. A disabled Shaper costs nothing."""

    def __init__(
        self,
        rate_mbit: float | None = None,
        delay_ms: float = 0.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate_mbit = rate_mbit
        self.delay = max(0.0, float(delay_ms)) / 1000.0
        self._clock = clock
        self._sleep = sleep
        self.bucket: TokenBucket | None = None
        if rate_mbit:
            rate = rate_mbit * 1e6 / 8
            self.bucket = TokenBucket(rate, max(MIN_BURST, int(rate * 0.005)), clock=clock,
                                      sleep=sleep)

    @classmethod
    def from_config(cls, cfg: ShapingConfig) -> Shaper:
        return cls(cfg.rate_mbit, cfg.delay_ms)

    @property
    def enabled(self) -> bool:
        return self.bucket is not None or self.delay > 0

    def stamp(self) -> float:
        """The time to record when a frame is queued (pass it to :meth:`send`)."""
        return self._clock()

    def send(
        self,
        sendall: Callable[[bytes | memoryview], object],
        parts: Iterable[bytes | memoryview],
        queued_at: float,
    ) -> int:
        """Write ``parts`` with ``sendall`` once the delay has passed, paced by the bucket.

        Returns the number of bytes written.
        """
        if self.delay:
            wait = queued_at + self.delay - self._clock()
            if wait > 0:
                self._sleep(wait)
        total = 0
        for part in parts:
            view = memoryview(part).cast("B")
            total += len(view)
            if self.bucket is None:
                sendall(view)
                continue
            step = self.bucket.burst
            for off in range(0, len(view), step):
                piece = view[off : off + step]
                self.bucket.take(len(piece))
                sendall(piece)
        return total
