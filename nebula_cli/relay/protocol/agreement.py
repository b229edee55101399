"""Round agreement: who takes part in a round, decided by one coordinator per round.

The coordinator of a round is the first cluster in the job's order among a relay and its
connected peers. :class:`Coordinator` collects the READYs of a round (each with the cluster's
lineage and its :class:`~nebula_cli.relay.protocol.pacing.RoundInfo`) and decides a
:class:`Decision` as soon as every cluster still reachable is ready, or ``round_timeout`` after the
first READY: who is present, missing, rejected or diverged, the weights of the average, with
``inner_steps: auto`` the next round's H, and with ``compression: auto`` the round's codec (the
one named by the newest decision any READY knows; a cluster that encoded with another, e.g.
after its relay restarted, is rejected and fetches the average) and the next round's
(relay.codec_choice). A READY for a round some relay already completed gets
:data:`BEHIND` (that cluster catches up instead). A cluster whose newest READY is for a later
round will not be ready for an earlier one (after a resume, clusters can restart from rounds one
apart: the one that ran a last round alone when it was stopped is ahead): nobody waits for it
there.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from nebula_cli.config.relay_config import AutoCodec, AutoSteps
from nebula_cli.relay.codecs.choice import CodecCosts, choose_codec
from nebula_cli.relay.net.schema import wire
from nebula_cli.relay.protocol.lineage import GENESIS, diverged
from nebula_cli.relay.protocol.next_round import WHY_CHARS, NextRound
from nebula_cli.relay.protocol.pacing import (
    CODEC_CHARS,
    RoundInfo,
    choose_inner_steps,
    choose_merge_steps,
    round_weights,
)

log = logging.getLogger("nebula.relay")


class Verdict(StrEnum):
    """A coordinator's answer to a READY that is not a decision."""

    BEHIND = "behind"
    """Some relay already completed that round: the cluster catches up instead."""


BEHIND = Verdict.BEHIND


@dataclass(frozen=True, kw_only=True)
class Decision:
    """Who takes part in attempt ``attempt`` of round ``round``, as decided by ``coordinator``
    (the START message of round control)."""

    NAME: ClassVar[str] = "round decision"

    round: int
    attempt: int = wire(low=0)
    coordinator: str = wire(key="coord")
    present: tuple[str, ...]
    rejected: tuple[str, ...]
    missing: tuple[str, ...]
    numel: int = wire(low=0)
    diverged: tuple[str, ...] = ()
    """Clusters ready but not on the round's winning lineage (see relay.lineage): they take a
    present peer's global state instead of contributing."""
    weights: tuple[tuple[str, float], ...] = ()
    """(cluster, samples) of every present cluster when all said (relay.cadence): the
    average's weights; empty: an equal average. On the wire an object; as read, a positive
    number for exactly the present clusters."""
    codec: str = wire("", max_chars=CODEC_CHARS)
    """``compression: auto``: the codec of this round (the one most READYs were encoded with;
    a cluster that encoded with another is rejected and fetches the average)."""
    next: NextRound = wire(NextRound(), flat=True)
    """What the next round is: with ``inner_steps: auto`` its H, with ``compression: auto``
    its codec, with overlap its merge step, and why."""

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.round, self.attempt, self.coordinator)

    def problem(self) -> str | None:
        """Why a decision as a peer sent it cannot be: its weights are not a positive number
        for exactly the present clusters (None: it can)."""
        w = self.weights
        if w and ({c for c, _ in w} != set(self.present)
                  or not all(math.isfinite(x) and x > 0 for _, x in w)):
            return f"round decision with weights {dict(w)} for present {list(self.present)}"
        return None


@dataclass
class _Collection:
    deadline: float
    ready: dict[str, tuple[bool, int, str]] = field(default_factory=dict)  # ok, numel, reason
    lineage: dict[str, str] = field(default_factory=dict)
    info: dict[str, RoundInfo] = field(default_factory=dict)
    codec: dict[str, tuple[str, int]] = field(default_factory=dict)


def _round_codec(said: list[tuple[str, int]]) -> str:
    """A round's codec from what its READYs say (codec, round of the decision that named it):
    the one named by the newest decision (a relay that restarted, or missed decisions, is the
    one left out), then the most common, then the earliest in the job's order; "" for none."""
    newest = max((r for _, r in said), default=-1)
    names = [c for c, r in said if r == newest]
    return max(names, key=names.count, default="")


class Coordinator:
    """Collects READY(round, attempt) messages and decides who is present.

    A round is decided as soon as every cluster of the job that is still reachable is ready, or
    ``round_timeout`` after the first READY of that round arrived. Readiness of a round that
    some relay has already completed (``newest_done``) but which this coordinator has no
    decision for is answered with :data:`BEHIND`: that cluster catches up instead.
    """

    KEEP = 16
    """Decisions remembered (a late READY gets the decision again)."""

    def __init__(self, me: str, clusters: Sequence[str], round_timeout: float,
                 auto: AutoSteps | None = None, auto_codec: AutoCodec | None = None,
                 nbytes: Mapping[str, float] | None = None) -> None:
        self.me = me
        self.auto = auto
        """``inner_steps: auto``: decisions carry the next H (relay.cadence)."""
        self.auto_codec = auto_codec
        """``compression: auto``: decisions carry the round's and the next codec
        (relay.codec_choice); ``nbytes``: each candidate's payload bytes per element."""
        self.nbytes = dict(nbytes or {})
        self.costs = CodecCosts()
        self.clusters = list(clusters)
        self.round_timeout = round_timeout
        self._open: dict[tuple[int, int], _Collection] = {}
        self._decided: dict[int, Decision] = {}
        self._said: dict[str, int] = {}
        """Each cluster's newest READY's round."""
        self._lock = threading.Lock()

    def ready(
        self, round_id: int, attempt: int, cluster: str, *, ok: bool, numel: int, reason: str = "",
        now: float, newest_done: int, lineage: str = GENESIS,
        expected: Sequence[str] | None = None, info: RoundInfo | None = None,
        codec: tuple[str, int] = ("", -1),
    ) -> Decision | Verdict | None:
        """Record a READY; returns a Decision (new or remembered), BEHIND, or None (wait).

        ``codec``: the codec the cluster encoded with and the round of the decision that named
        it (-1: none since its relay started). ``expected``: the clusters that can still be
        ready (this relay and its connected peers; default every cluster of the job): once they
        all are, the round is decided without waiting for the others. A READY for a later
        attempt of an open round carries the collection over to that attempt (a cluster that
        never saw the failed attempt's decision and one that retries it end up in the same
        decision)."""
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
            col.info[cluster] = info or RoundInfo()
            col.codec[cluster] = codec
            self._said[cluster] = round_id
            if self._all_ready(key[0], col, self.clusters if expected is None else expected):
                return self._decide(*key)
            return None

    def complete(self, expected: Sequence[str]) -> list[Decision]:
        """Decide the open rounds in which every cluster of ``expected`` is ready, or already
        ready for a later round (called when a peer is gone: nobody waits for it until the
        deadline, and after each READY: nobody waits for a cluster that is past the round)."""
        with self._lock:
            keys = [k for k, col in self._open.items()
                    if col.ready and self._all_ready(k[0], col, expected)]
            return [self._decide(*key) for key in sorted(keys)]

    def _all_ready(self, round_id: int, col: _Collection, expected: Sequence[str]) -> bool:
        """Whether every cluster of ``expected`` is ready for ``round_id`` or past it."""
        return all(c in col.ready or self._said.get(c, -1) > round_id for c in expected)

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
        codec = _round_codec([col.codec[c] for c in ok]) if self.auto_codec else ""
        fitting = [c for c in ok if col.ready[c][1] == numel
                   and (not self.auto_codec or col.codec[c][0] == codec)]
        lost = diverged({c: col.lineage[c] for c in fitting}, self.clusters)
        present = [c for c in fitting if c not in lost]
        rejected = [c for c in order if c not in fitting]
        missing = [c for c in self.clusters if c not in col.ready]
        steps = choose_inner_steps(self.auto, col.info) if self.auto else None
        next_h, why = steps if steps else (None, "")
        next_codec = codec
        if self.auto_codec is not None:
            pick = choose_codec(self.auto_codec, self.auto, codec, col.info, self.costs,
                                self.nbytes)
            if pick is not None:
                next_codec, why = pick.codec, pick.why
                next_h = pick.h if pick.h is not None else next_h
        last = self._decided[max(self._decided)] if self._decided else None
        merge = choose_merge_steps({c: col.info[c] for c in present if c in col.info},
                                   last.next.merge if last else None)
        next_merge = merge[0] if merge else None
        if merge and (last is None or last.next.merge != next_merge):
            log.info("round %d: next %s", round_id, merge[1])
        d = Decision(round=round_id, attempt=attempt, coordinator=self.me,
                     present=tuple(sorted(present)), rejected=tuple(sorted(rejected)),
                     missing=tuple(sorted(missing)), numel=numel, diverged=tuple(sorted(lost)),
                     weights=tuple(sorted(round_weights(present, col.info).items())), codec=codec,
                     next=NextRound(h=next_h, merge=next_merge, codec=next_codec,
                                    why=why[:WHY_CHARS]))
        if why:
            log.info("round %d: next%s%s (%s)", round_id,
                     "" if next_h is None else f" H {next_h}",
                     f", codec {next_codec}" if next_codec else "", why)
        self._decided[round_id] = d
        for old in sorted(self._decided)[: -self.KEEP]:
            del self._decided[old]
        for key in [k for k in self._open if k[0] == round_id and k[1] < attempt]:
            del self._open[key]
        return d
