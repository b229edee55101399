"""Counting evaluations: every full score of a candidate partition costs one unit of budget.

Partitions travel as label vectors: ``labels[u]`` is the group of device u, every group holding
exactly `dp` devices. A candidate scored before is looked up, never rescored nor recounted;
searchers skip such candidates instead of spending budget on them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from nebula_cli.planner.costmodel import CostModel, Evaluation


class Exhausted(Exception):
    """The evaluation budget is spent (control flow inside the searchers, never user-facing)."""


def groups_of(labels: np.ndarray, stages: int) -> np.ndarray:
    """Stages x dp device indices, group by group, each row in increasing device order."""
    return np.argsort(labels, kind="stable").reshape(stages, -1)


def key_of(groups: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """The partition regardless of group labels: its groups as sorted tuples, sorted."""
    return tuple(sorted(tuple(row) for row in groups.tolist()))


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
    seen: dict[tuple[tuple[int, ...], ...], float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    @property
    def left(self) -> int:
        return self.budget - self.count

    def known(self, groups: np.ndarray) -> float | None:
        """The score of a candidate already evaluated, else None (free)."""
        return self.seen.get(key_of(groups))

    def score(self, labels: np.ndarray) -> Scored:
        """Evaluate one candidate (one unit of budget); Exhausted when none is left."""
        if self.count >= self.budget:
            raise Exhausted
        groups = groups_of(labels, self.model.task.stages)
        evaluation = self.model.evaluate(groups.tolist())
        self.count += 1
        scored = Scored(labels.copy(), groups, evaluation)
        self.seen[key_of(groups)] = scored.score
        if self.best is None or scored.score < self.best.score:
            self.best = scored
        self.trace.append(self.best.score)
        return scored
