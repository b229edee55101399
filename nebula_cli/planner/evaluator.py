"""Counting evaluations: every full score of a candidate partition costs one unit of budget.

Partitions travel as label vectors: ``labels[u]`` is the group of device u, every group holding
exactly `dp` devices. A candidate scored before is looked up, never rescored nor recounted;
searchers skip such candidates instead of spending budget on them. A candidate one swap away from
a scored one may be scored incrementally (`score_swap`, see incremental.py); it counts the same.

The evaluator also owns the stopping rules (the budget, an optional wall-clock limit) and reports
progress to an optional callback at most every PROGRESS_EVERY seconds.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from nebula_cli.planner.costmodel import CostModel, Evaluation
from nebula_cli.planner.incremental import swap_evaluation, swapped

PROGRESS_EVERY = 0.25
"""Seconds between two progress reports."""

SearchProgress = Callable[[int, float, float], None]
"""on_progress(evaluations so far, best score so far, seconds elapsed)."""


class Exhausted(Exception):
    """The evaluation budget is spent (control flow inside the searchers, never user-facing)."""


def groups_of(labels: np.ndarray, stages: int) -> np.ndarray:
    """Stages x dp device indices, group by group, each row in increasing device order."""
    return np.argsort(labels, kind="stable").reshape(stages, -1)


def key_of(groups: np.ndarray) -> bytes:
    """The partition regardless of group labels: a digest of its groups (rows sorted), in the
    order of their first members."""
    rows = np.sort(np.asarray(groups, dtype=np.int64), axis=1)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    return hashlib.blake2b(rows.tobytes(), digest_size=16).digest()


@dataclass
class Scored:
    """One evaluated candidate."""

    labels: np.ndarray
    groups: np.ndarray
    evaluation: Evaluation

    @property
    def score(self) -> float:
        return self.evaluation.cost.score


@dataclass
class Evaluator:
    """Scores candidates against a budget and remembers the best one and the trace."""

    model: CostModel
    budget: int
    count: int = 0
    best: Scored | None = None
    trace: list[float] = field(default_factory=list)
    """Best score after each evaluation."""
    seen: dict[bytes, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    time_limit: float | None = None
    """Seconds after `started` at which no more evaluations are made (None: no limit)."""
    on_progress: SearchProgress | None = None
    timed_out: bool = False
    _reported: float = 0.0

    @property
    def left(self) -> int:
        return self.budget - self.count

    def _spend(self) -> None:
        """One unit of budget, or Exhausted (budget spent or time up)."""
        if self.count >= self.budget:
            raise Exhausted
        if self.time_limit is not None and self.count and \
                time.perf_counter() - self.started >= self.time_limit:
            self.timed_out = True
            raise Exhausted
        self.count += 1

    def _record(self, scored: Scored) -> Scored:
        self.seen[key_of(scored.groups)] = scored.score
        if self.best is None or scored.score < self.best.score:
            self.best = scored
        self.trace.append(self.best.score)
        if self.on_progress is not None:
            now = time.perf_counter()
            if now - self._reported >= PROGRESS_EVERY:
                self._reported = now
                self.on_progress(self.count, self.best.score, now - self.started)
        return scored

    def known(self, groups: np.ndarray) -> float | None:
        """The score of a candidate already evaluated, else None (free)."""
        return self.seen.get(key_of(groups))

    def score(self, labels: np.ndarray) -> Scored:
        """Evaluate one candidate (one unit of budget); Exhausted when none is left."""
        self._spend()
        groups = groups_of(labels, self.model.task.stages)
        return self._record(Scored(labels.copy(), groups, self.model.evaluate(groups.tolist())))

    def score_swap(self, parent: Scored, u: int, v: int) -> Scored:
        """Evaluate `parent` with devices u and v swapped, incrementally (one unit of budget)."""
        self._spend()
        labels, groups = swapped(parent.labels, parent.groups, u, v)
        return self._record(Scored(labels, groups, swap_evaluation(
            self.model, parent.evaluation, parent.groups, groups, u, v)))
