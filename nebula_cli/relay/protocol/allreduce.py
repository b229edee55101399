"""The averaging schedule of one round, independent of sockets and threads.

A round is decided by a coordinator (:mod:`nebula_cli.relay.protocol.agreement`, run by the first
cluster in the job's order that a relay can reach): the clusters whose contribution is ready (and
finite) by the deadline are *present*, the others are *missing* (not ready), *rejected*
(non-finite update, wrong size) or *diverged* (ready, but their global state is not the round's
winning lineage: see :mod:`nebula_cli.relay.protocol.lineage`). Every relay then runs a
:class:`RoundExchange` over a :class:`Schedule`:

- 1 present cluster ("alone"): the result is its own contribution as decoded from its encoding.
- 2 present ("direct"): each relay sends its encoded contribution to the other; both decode both
  encodings and average them.
- 3 or more ("shard"): chunk ``k`` of the vector is owned by ``present[k % n]``. Every relay sends
  its encoded chunk ``k`` to that owner; the owner decodes the n encodings, averages, encodes the
  average once and sends it to the others; everyone (the owner too) uses the *decoded* encoded
  average. Each relay sends and receives about 2x the encoded model size whatever n is.
- sparse codecs (topk) use "direct" for any n: every relay sends its encoded contribution to
  every other and averages all the decoded parts itself. Re-encoding a sum of sparse parts would
  either drop coordinates or need about n times the room per average; sending each part to
  n - 1 peers costs (n - 1) contributions per relay, which are small, and the average is exact
  (the sum of every coordinate any cluster sent, divided by n).

Where the work runs: a relay's own chunks are averaged by the round's thread as they are added;
with ``worker=True`` a peer's chunk is only queued by the link that received it, and one thread
per exchange decodes and averages the queued chunks, so a link's receiver keeps reading (and
decrypting) while the averaging runs on another core.

Identical results everywhere: a contribution is only ever used as decoded from its encoded form
(also by its own relay), decoding is deterministic, and :func:`ordered_mean` sums the parts in
sorted cluster-name order and then divides by their count (or, when the decision weights the
clusters by the samples they trained on, adds each part times its share in that order). A
decoded chunk that is not finite is dropped from that chunk's average (every relay that averages
that chunk sees the same bytes, so all decide alike); an average that is not finite becomes
zeros.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nebula_cli.errors import NebulaError
from nebula_cli.relay.codecs.base import all_finite
from nebula_cli.relay.protocol.results import RoundMode


class ExchangeError(NebulaError):
    """A peer sent something the round's schedule does not allow (wrong chunk, size, sender)."""


def ordered_mean(parts: Mapping[str, torch.Tensor], out: torch.Tensor | None = None,
                 weights: Mapping[str, float] | None = None) -> torch.Tensor:
    """Sum of ``parts`` in sorted key order, divided by their number (into ``out`` or new).

    Every relay calls this with the same decoded tensors, so the bits agree everywhere; the
    exact reference is ``(p[a] + p[b] + p[c]) / 3`` with a < b < c. With ``weights`` (for every
    part) that are not all equal: ``p[a] * (w[a] / W) + p[b] * (w[b] / W) + ...`` in sorted
    order, ``W`` the sum of the parts' weights (the same bits on every relay as well).
    """
    names = sorted(parts)
    if not names:
        raise ValueError("ordered_mean of nothing")
    first = parts[names[0]]
    if out is None:
        out = torch.empty(first.numel(), dtype=torch.float32)
    ws = [float(weights[n]) for n in names] if weights else None
    if ws is not None and len(set(ws)) > 1:
        total = math.fsum(ws)
        torch.mul(first, ws[0] / total, out=out)
        for name, w in zip(names[1:], ws[1:], strict=True):
            out.add_(parts[name], alpha=w / total)
        return out
    if len(names) == 1:
        out.copy_(first)
    else:
        torch.add(first, parts[names[1]], out=out)
    for name in names[2:]:
        out.add_(parts[name])
    return out.div_(len(names))


def _empty(numel: int) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.float32)


@dataclass(frozen=True)
class Schedule:
    """Who sends which chunk to whom in one round, seen from relay ``me``."""

    me: str
    present: tuple[str, ...]
    num_chunks: int
    all_to_all: bool = False
    """Every relay sends its chunks to every other and averages them all itself (sparse
    codecs: exact sums, no re-encoded average), whatever the number of clusters."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "present", tuple(sorted(self.present)))
        if self.me not in self.present:
            raise ValueError(f"{self.me} is not present in {self.present}")

    @property
    def mode(self) -> RoundMode:
        n = len(self.present)
        return (RoundMode.ALONE if n == 1 else RoundMode.DIRECT if n == 2 or self.all_to_all
                else RoundMode.SHARD)

    @property
    def others(self) -> tuple[str, ...]:
        return tuple(c for c in self.present if c != self.me)

    def owner(self, k: int) -> str | None:
        """The relay that averages chunk ``k`` (shard mode), None when every relay does."""
        return self.present[k % len(self.present)] if self.mode == RoundMode.SHARD else None

    def contributors(self, k: int) -> tuple[str, ...]:
        """Clusters whose chunk ``k`` this relay averages (empty: it receives the average)."""
        owner = self.owner(k)
        return self.present if owner in (None, self.me) else ()

    def contrib_targets(self, k: int) -> tuple[str, ...]:
        """Where this relay's encoded chunk ``k`` goes."""
        owner = self.owner(k)
        if owner is None:
            return self.others
        return () if owner == self.me else (owner,)

    def contrib_sources(self, k: int) -> tuple[str, ...]:
        return tuple(c for c in self.contributors(k) if c != self.me)

    def avg_targets(self, k: int) -> tuple[str, ...]:
        """Where this relay sends its encoded average of chunk ``k`` (shard owners only)."""
        return self.others if self.owner(k) == self.me else ()

    def avg_source(self, k: int) -> str | None:
        owner = self.owner(k)
        return owner if owner not in (None, self.me) else None


Send = Callable[[str, str, int, Any], None]
"""send(dest_cluster, kind ("contrib" | "avg"), chunk index, encoded or None (= zeros))."""


class RoundExchange:
    """One relay's part of one round: feeds chunks in, averages owned chunks, sends, assembles.

    Thread-safe: own chunks, peer contributions and peer averages may arrive from different
    threads in any order. ``encode``/``decode`` are the round's codec; ``send`` queues a chunk for
    a peer (it must not block on the network).
    """

    def __init__(
        self,
        schedule: Schedule,
        bounds: Sequence[tuple[int, int]],
        *,
        encode: Callable[[torch.Tensor], Any],
        decode: Callable[[Any], torch.Tensor],
        send: Send,
        weights: Mapping[str, float] | None = None,
        empty: Callable[[int], torch.Tensor] | None = None,
        worker: bool = False,
        codec: str = "",
    ) -> None:
        if len(bounds) != schedule.num_chunks:
            raise ValueError("bounds and schedule disagree on the number of chunks")
        self.schedule = schedule
        self.codec = codec
        """The round's codec by name: chunks encoded with another are refused."""
        self.bounds = list(bounds)
        self._encode = encode
        self._decode = decode
        self._send = send
        self.weights = dict(weights or {})
        """Each present cluster's weight in the average (empty: equal weights)."""
        numel = self.bounds[-1][1] if self.bounds else 0
        self.result = (empty or _empty)(numel)
        """The average, built in place (``empty(numel)`` makes it: memory a local worker can
        map, see relay.local.shared_empty)."""
        self.dropped: set[str] = set()
        """Clusters with a non-finite decoded chunk (left out of that chunk's average)."""
        self.zeroed = 0
        """Chunks whose average was not finite and became zeros."""
        self.error: str | None = None
        self.progress_at = time.monotonic()
        self._parts: dict[int, dict[str, Any]] = {}
        """Chunks not complete yet: each contribution as it was encoded."""
        self._left = set(range(len(self.bounds)))
        self._cv = threading.Condition()
        self._queue: deque[tuple[bool, str, int, Any]] = deque()  # (is average, src, k, enc)
        self._worker: threading.Thread | None = None
        if worker and self._left:
            self._worker = threading.Thread(target=self._work, name="relay-average", daemon=True)
            self._worker.start()

    # ------------------------------------------------------------------ inputs

    def add_own(self, k: int, enc: Any) -> None:
        """This relay's encoded chunk ``k``: sent to its targets, and averaged if owned here."""
        for dest in self.schedule.contrib_targets(k):
            self._send(dest, "contrib", k, enc)
        if self.schedule.contributors(k):
            self._add_part(self.schedule.me, k, enc)

    def add_contrib(self, src: str, k: int, enc: Any) -> None:
        """A peer's encoded chunk ``k`` (ExchangeError if the schedule does not expect it)."""
        self._check_k(k)
        if src not in self.schedule.contrib_sources(k):
            raise ExchangeError(f"{src} sent contribution chunk {k}, not averaged here")
        if not self._queued(False, src, k, enc):
            self._add_part(src, k, enc)

    def add_avg(self, src: str, k: int, enc: Any) -> None:
        """The owner's encoded average of chunk ``k`` (None = zeros)."""
        self._check_k(k)
        if src != self.schedule.avg_source(k):
            raise ExchangeError(f"{src} sent the average of chunk {k}, owned by "
                                f"{self.schedule.owner(k)}")
        if not self._queued(True, src, k, enc):
            self._use_avg(k, enc)

    def _use_avg(self, k: int, enc: Any) -> None:
        t = self._zeros(k) if enc is None else self._decoded(k, enc)
        if not all_finite(t):
            t = self._zeros(k)
            with self._cv:
                self.zeroed += 1
        self._finish(k, t)

    def fail(self, reason: str) -> None:
        """End the exchange unsuccessfully (a present peer went away, an abort, a stall)."""
        with self._cv:
            if self._left and self.error is None:
                self.error = reason
            self._cv.notify_all()

    # ------------------------------------------------------------------ state

    @property
    def done(self) -> bool:
        with self._cv:
            return not self._left

    def wait(self, timeout: float | None) -> bool:
        """Wait until complete (True) or failed / timed out (False)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._left or self.error is not None, timeout)
            return not self._left

    # ------------------------------------------------------------------ the worker

    def _queued(self, avg: bool, src: str, k: int, enc: Any) -> bool:
        """With a worker: queue a peer's chunk for it (the caller, a link's receiver, goes back
        to reading at once) and say so."""
        if self._worker is None:
            return False
        with self._cv:
            self._queue.append((avg, src, k, enc))
            self.progress_at = time.monotonic()
            self._cv.notify_all()
        return True

    def _work(self) -> None:
        """The worker: decode and average the peers' chunks as they are queued, until the
        exchange is complete or failed."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or not self._left or self.error is not None)
                if not self._queue or self.error is not None:
                    self._queue.clear()
                    return
                avg, src, k, enc = self._queue.popleft()
            try:
                if avg:
                    self._use_avg(k, enc)
                else:
                    self._add_part(src, k, enc)
            except Exception as exc:  # noqa: BLE001 (the exchange fails and says why)
                self.fail(f"bad chunk {k} from {src}: {exc}")

    # ------------------------------------------------------------------ internals

    def _check_k(self, k: int) -> None:
        if not isinstance(k, int) or not 0 <= k < len(self.bounds):
            raise ExchangeError(f"chunk index {k!r} out of range (0..{len(self.bounds) - 1})")

    def _zeros(self, k: int) -> torch.Tensor:
        lo, hi = self.bounds[k]
        return torch.zeros(hi - lo, dtype=torch.float32)

    def _decoded(self, k: int, enc: Any, src: str = "") -> torch.Tensor:
        lo, hi = self.bounds[k]
        sender = f" from {src}" if src else ""
        try:
            t = self._decode(enc)
        except NebulaError as exc:
            raise ExchangeError(f"chunk {k}{sender} does not decode: {exc}") from exc
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != hi - lo:
            raise ExchangeError(f"chunk {k}{sender} decodes to {tuple(t.shape)} {t.dtype}, "
                                f"expected ({hi - lo},) float32")
        return t

    def _add_part(self, src: str, k: int, enc: Any) -> None:
        """One contribution to chunk ``k``, held encoded until the chunk's last one arrives,
        then every part decoded and averaged: this relay's own chunks are encoded faster than
        its peers' arrive over the WAN, and held decoded they would add up to a whole fp32
        copy of the vector (an int8 encoding is a quarter of it)."""
        with self._cv:
            if self.error is not None:
                return
            parts = self._parts.setdefault(k, {})
            if src in parts or k not in self._left:
                raise ExchangeError(f"{src} sent chunk {k} twice")
            parts[src] = enc
            self.progress_at = time.monotonic()
            complete = len(parts) == len(self.schedule.contributors(k))
            if complete:
                del self._parts[k]
        if complete:
            self._reduce(k, {c: self._decoded(k, e, c) for c, e in parts.items()})

    def _mean(self, k: int, parts: dict[str, torch.Tensor], out: torch.Tensor | None
              ) -> tuple[torch.Tensor, bool]:
        """ordered_mean of the finite parts, and whether it is finite. A finite mean means every
        part was finite (NaN and inf propagate), so the parts are only checked one by one when
        it is not (the mean of finite parts can still overflow)."""
        avg = ordered_mean(parts, out=out, weights=self.weights)
        if all_finite(avg):
            return avg, True
        good = {c: t for c, t in parts.items() if all_finite(t)}
        with self._cv:
            self.dropped.update(set(parts) - set(good))
        if not good:
            return self._zeros(k), True
        avg = ordered_mean(good, out=out, weights=self.weights)
        return avg, all_finite(avg)

    def _reduce(self, k: int, parts: dict[str, torch.Tensor]) -> None:
        lo, hi = self.bounds[k]
        targets = self.schedule.avg_targets(k)
        if not targets:  # averaged here, used as is: straight into the result
            avg, finite = self._mean(k, parts, self.result[lo:hi])
            if not finite:
                avg = self._zeros(k)
                with self._cv:
                    self.zeroed += 1
            self._finish(k, avg)
            return
        avg, finite = self._mean(k, parts, None)
        enc: Any = self._encode(avg) if finite else None
        avg = self._decoded(k, enc) if enc is not None else self._zeros(k)
        if not all_finite(avg):
            enc, avg = None, self._zeros(k)
        if enc is None:
            with self._cv:
                self.zeroed += 1
        for dest in targets:
            self._send(dest, "avg", k, enc)
        self._finish(k, avg)

    def _finish(self, k: int, t: torch.Tensor) -> None:
        lo, hi = self.bounds[k]
        with self._cv:
            if k not in self._left:
                raise ExchangeError(f"chunk {k} completed twice")
            if t.data_ptr() != self.result[lo:hi].data_ptr():
                self.result[lo:hi].copy_(t)
            self._left.discard(k)
            self.progress_at = time.monotonic()
            self._cv.notify_all()
