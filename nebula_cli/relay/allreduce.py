"""The averaging schedule of one round, independent of sockets and threads.

A round is decided by a coordinator (:class:`Coordinator`, run by the first cluster in the job's
order that a relay can reach): the clusters whose contribution is ready (and finite) by the
deadline are *present*, the others are *missing* (not ready), *rejected* (non-finite update,
wrong size) or *diverged* (ready, but their global state is not the round's winning lineage:
see :mod:`nebula_cli.relay.lineage`). Every relay then runs a :class:`RoundExchange` over a
:class:`Schedule`:

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

Identical results everywhere: a contribution is only ever used as decoded from its encoded form
(also by its own relay), decoding is deterministic, and :func:`ordered_mean` sums the parts in
sorted cluster-name order and then divides by their count. A decoded chunk that is not finite is
dropped from that chunk's average (every relay that averages that chunk sees the same bytes, so
all decide alike); an average that is not finite becomes zeros.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nebula_cli.errors import NebulaError
from nebula_cli.relay.lineage import GENESIS, diverged

ALONE, DIRECT, SHARD = "alone", "direct", "shard"
BEHIND = "behind"


class ExchangeError(NebulaError):
    """A peer sent something the round's schedule does not allow (wrong chunk, size, sender)."""


def ordered_mean(parts: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Sum of ``parts`` in sorted key order, divided by their number (into ``out`` or new).

    Every relay calls this with the same decoded tensors, so the bits agree everywhere; the
    exact reference is ``(p[a] + p[b] + p[c]) / 3`` with a < b < c.
    """
    names = sorted(parts)
    if not names:
        raise ValueError("ordered_mean of nothing")
    first = parts[names[0]]
    if out is None:
        out = torch.empty(first.numel(), dtype=torch.float32)
    if len(names) == 1:
        out.copy_(first)
    else:
        torch.add(first, parts[names[1]], out=out)
    for name in names[2:]:
        out.add_(parts[name])
    return out.div_(len(names))


def is_finite(t: torch.Tensor) -> bool:
    """No NaN and no infinity (two reductions, no temporary the size of ``t``)."""
    if not t.numel():
        return True
    return math.isfinite(float(t.amin())) and math.isfinite(float(t.amax()))


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
    def mode(self) -> str:
        n = len(self.present)
        return ALONE if n == 1 else DIRECT if n == 2 or self.all_to_all else SHARD

    @property
    def others(self) -> tuple[str, ...]:
        return tuple(c for c in self.present if c != self.me)

    def owner(self, k: int) -> str | None:
        """The relay that averages chunk ``k`` (shard mode), None when every relay does."""
        return self.present[k % len(self.present)] if self.mode == SHARD else None

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
    ) -> None:
        if len(bounds) != schedule.num_chunks:
            raise ValueError("bounds and schedule disagree on the number of chunks")
        self.schedule = schedule
        self.bounds = list(bounds)
        self._encode = encode
        self._decode = decode
        self._send = send
        numel = self.bounds[-1][1] if self.bounds else 0
        self.result = torch.empty(numel, dtype=torch.float32)
        self.dropped: set[str] = set()
        """Clusters with a non-finite decoded chunk (left out of that chunk's average)."""
        self.zeroed = 0
        """Chunks whose average was not finite and became zeros."""
        self.error: str | None = None
        self.progress_at = time.monotonic()
        self._parts: dict[int, dict[str, torch.Tensor]] = {}
        self._left = set(range(len(self.bounds)))
        self._cv = threading.Condition()

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
        self._add_part(src, k, enc)

    def add_avg(self, src: str, k: int, enc: Any) -> None:
        """The owner's encoded average of chunk ``k`` (None = zeros)."""
        self._check_k(k)
        if src != self.schedule.avg_source(k):
            raise ExchangeError(f"{src} sent the average of chunk {k}, owned by "
                                f"{self.schedule.owner(k)}")
        t = self._zeros(k) if enc is None else self._decoded(k, enc)
        if not is_finite(t):
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

    # ------------------------------------------------------------------ internals

    def _check_k(self, k: int) -> None:
        if not isinstance(k, int) or not 0 <= k < len(self.bounds):
            raise ExchangeError(f"chunk index {k!r} out of range (0..{len(self.bounds) - 1})")

    def _zeros(self, k: int) -> torch.Tensor:
        lo, hi = self.bounds[k]
        return torch.zeros(hi - lo, dtype=torch.float32)

    def _decoded(self, k: int, enc: Any) -> torch.Tensor:
        lo, hi = self.bounds[k]
        try:
            t = self._decode(enc)
        except NebulaError as exc:
            raise ExchangeError(f"chunk {k} does not decode: {exc}") from exc
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != hi - lo:
            raise ExchangeError(f"chunk {k} decodes to {tuple(t.shape)} {t.dtype}, "
                                f"expected ({hi - lo},) float32")
        return t

    def _add_part(self, src: str, k: int, enc: Any) -> None:
        t = self._decoded(k, enc)
        with self._cv:
            if self.error is not None:
                return
            parts = self._parts.setdefault(k, {})
            if src in parts or k not in self._left:
                raise ExchangeError(f"{src} sent chunk {k} twice")
            parts[src] = t
            self.progress_at = time.monotonic()
            complete = len(parts) == len(self.schedule.contributors(k))
            if complete:
                del self._parts[k]
        if complete:
            self._reduce(k, parts)

    def _mean(self, k: int, parts: dict[str, torch.Tensor], out: torch.Tensor | None
              ) -> torch.Tensor:
        """ordered_mean of the finite parts. A finite mean means every part was finite (NaN and
        inf propagate), so the parts are only checked one by one when it is not."""
        avg = ordered_mean(parts, out=out)
        if is_finite(avg):
            return avg
        good = {c: t for c, t in parts.items() if is_finite(t)}
        with self._cv:
            self.dropped.update(set(parts) - set(good))
        return ordered_mean(good, out=out) if good else self._zeros(k)

    def _reduce(self, k: int, parts: dict[str, torch.Tensor]) -> None:
        lo, hi = self.bounds[k]
        targets = self.schedule.avg_targets(k)
        if not targets:  # averaged here, used as is: straight into the result
            avg = self._mean(k, parts, self.result[lo:hi])
            if not is_finite(avg):
                avg = self._zeros(k)
                with self._cv:
                    self.zeroed += 1
            self._finish(k, avg)
            return
        avg = self._mean(k, parts, None)
        enc: Any = self._encode(avg) if is_finite(avg) else None
        avg = self._decoded(k, enc) if enc is not None else self._zeros(k)
        if not is_finite(avg):
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


# ---------------------------------------------------------------------- agreement


@dataclass(frozen=True)
class Decision:
    """Who takes part in attempt ``attempt`` of round ``round``, as decided by ``coordinator``."""

    round: int
    attempt: int
    coordinator: str
    present: tuple[str, ...]
    rejected: tuple[str, ...]
    missing: tuple[str, ...]
    numel: int
    diverged: tuple[str, ...] = ()
    """Clusters ready but not on the round's winning lineage (see relay.lineage): they take a
    present peer's global state instead of contributing."""

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.round, self.attempt, self.coordinator)

    def to_meta(self) -> dict[str, Any]:
        return {"round": self.round, "attempt": self.attempt, "coord": self.coordinator,
                "present": list(self.present), "rejected": list(self.rejected),
                "missing": list(self.missing), "numel": self.numel,
                "diverged": list(self.diverged)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Decision:
        try:
            d = cls(int(meta["round"]), int(meta["attempt"]), str(meta["coord"]),
                    tuple(map(str, meta["present"])), tuple(map(str, meta["rejected"])),
                    tuple(map(str, meta["missing"])), int(meta["numel"]),
                    tuple(map(str, meta.get("diverged", ()))))
        except (KeyError, TypeError, ValueError) as exc:
            raise ExchangeError(f"malformed round decision {dict(meta)!r}") from exc
        return d


@dataclass
class _Collection:
    deadline: float
    ready: dict[str, tuple[bool, int, str]] = field(default_factory=dict)  # ok, numel, reason
    lineage: dict[str, str] = field(default_factory=dict)


class Coordinator:
    """Collects READY(round, attempt) messages and decides who is present.

    A round is decided as soon as every cluster of the job that is still reachable is ready, or
    ``round_timeout`` after the first READY of that round arrived. Readiness of a round that
    some relay has already completed (``newest_done``) but which this coordinator has no
    decision for is answered with :data:`BEHIND`: that cluster catches up instead.
    """

    KEEP = 16
    """Decisions remembered (a late READY gets the decision again)."""

    def __init__(self, me: str, clusters: Sequence[str], round_timeout: float) -> None:
        self.me = me
        self.clusters = list(clusters)
        self.round_timeout = round_timeout
        self._open: dict[tuple[int, int], _Collection] = {}
        self._decided: dict[int, Decision] = {}
        self._lock = threading.Lock()

    def ready(
        self, round_id: int, attempt: int, cluster: str, *, ok: bool, numel: int, reason: str = "",
        now: float, newest_done: int, lineage: str = GENESIS,
        expected: Sequence[str] | None = None,
    ) -> Decision | str | None:
        """Record a READY; returns a Decision (new or remembered), BEHIND, or None (wait).

        ``expected``: the clusters that can still be ready (this relay and its connected peers;
        default every cluster of the job): once they all are, the round is decided without
        waiting for the others. A READY for a later attempt of an open round carries the
        collection over to that attempt (a cluster that never saw the failed attempt's decision
        and one that retries it end up in the same decision)."""
        with self._lock:
            old = self._decided.get(round_id)
            if old is not None and attempt <= old.attempt:
                return old
            if old is None and round_id <= newest_done:
                return BEHIND
            key = next((k for k in self._open if k[0] == round_id), None)
            if key is None:
                key = (round_id, attempt)
                self._open[key] = _Collection(now + self.round_timeout)
            elif attempt > key[1]:
                self._open[(round_id, attempt)] = self._open.pop(key)
                key = (round_id, attempt)
            col = self._open[key]
            col.ready[cluster] = (ok, numel, reason)
            col.lineage[cluster] = lineage
            if set(col.ready) >= set(self.clusters if expected is None else expected):
                return self._decide(*key)
            return None

    def complete(self, expected: Sequence[str]) -> list[Decision]:
        """Decide the open rounds in which every cluster of ``expected`` is ready (called when
        a peer is gone: nobody waits for it until the deadline)."""
        with self._lock:
            keys = [k for k, col in self._open.items() if col.ready
                    and set(col.ready) >= set(expected)]
            return [self._decide(*key) for key in sorted(keys)]

    def due(self, now: float) -> list[Decision]:
        """Decide every collection whose deadline has passed."""
        with self._lock:
            keys = [key for key, col in self._open.items() if col.deadline <= now]
            return [self._decide(*key) for key in sorted(keys)]

    def behind(self, newest_done: int) -> list[tuple[int, list[str]]]:
        """Close undecided collections of rounds some relay has already completed."""
        with self._lock:
            out = []
            for key in [k for k in self._open if k[0] <= newest_done]:
                if key[0] in self._decided:
                    continue
                out.append((key[0], list(self._open.pop(key).ready)))
            return out

    def drop_open(self) -> None:
        """Forget undecided collections (this relay is no longer the coordinator)."""
        with self._lock:
            self._open.clear()

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((c.deadline for c in self._open.values()), default=None)

    def decision(self, round_id: int) -> Decision | None:
        with self._lock:
            return self._decided.get(round_id)

    def _decide(self, round_id: int, attempt: int) -> Decision:
        col = self._open.pop((round_id, attempt))
        order = [c for c in self.clusters if c in col.ready]
        ok = [c for c in order if col.ready[c][0]]
        numel = col.ready[ok[0]][1] if ok else 0
        fitting = [c for c in ok if col.ready[c][1] == numel]
        lost = diverged({c: col.lineage[c] for c in fitting}, self.clusters)
        present = [c for c in fitting if c not in lost]
        rejected = [c for c in order if c not in fitting]
        missing = [c for c in self.clusters if c not in col.ready]
        d = Decision(round_id, attempt, self.me, tuple(sorted(present)), tuple(sorted(rejected)),
                     tuple(sorted(missing)), numel, tuple(sorted(lost)))
        self._decided[round_id] = d
        for old in sorted(self._decided)[: -self.KEEP]:
            del self._decided[old]
        for key in [k for k in self._open if k[0] == round_id and k[1] < attempt]:
            del self._open[key]
        return d
