"""When a cluster's next outer round is due, and what the cluster tells its relay about it.

Three cadences (spec: ``relay.sync``):

- every ``inner_steps`` optimizer steps (a fixed H);
- ``inner_steps: auto``: H starts at ``min_inner_steps`` and each round's result says the H
  for the next round (chosen by the relays from what every cluster reported, the same for all
  of them: `nebula_cli.relay.protocol.pacing`);
- ``every: 60s``: after that much training time, however many steps it took (a faster cluster
  does more steps; the relays weight the average by the samples each cluster trained on).
  The cluster's rank 0 keeps the time and tells the other ranks by a one-value broadcast per
  step, so every rank of the cluster stops at the same step.

With every round the cluster reports (`RoundInfo` on the relay's side) the samples since its
previous round (the weight of its delta), its mean seconds per step over those steps (training
only) and how long its previous round kept it from training; with overlap, also how long after
its boundary the previous round's average arrived. From that the relays agree on the step
after the boundary at which every cluster applies the next average (:attr:`merge_steps`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from nebula_cli.relay.protocol.next_round import NextRound
from nebula_cli.runtime.cluster_share import ClusterShare

FIRST_MERGE_STEPS = 1
"""Overlap: the merge step until the relays have agreed one (from the second round's READYs
on): the first rounds' averages are applied one step after their boundary, every cluster
waiting for its own, so that clusters started seconds apart merge at the same step too."""


class Cadence:
    """One cluster's round clock (on every rank; only rank 0's clock decides)."""

    def __init__(self, share: ClusterShare, *, inner_steps: int, every_s: float | None = None,
                 auto: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {inner_steps}")
        if every_s is not None and not every_s > 0:
            raise ValueError(f"every must be a positive number of seconds, got {every_s}")
        self.inner_steps = inner_steps
        """H: steps between rounds (with ``auto``, the one the last result said)."""
        self.every_s = every_s
        self.auto = auto
        self._share, self._clock = share, clock
        self._since = clock()
        self._paused = 0.0
        self._last_cost: float | None = None
        self._arrive_s: float | None = None
        self.merge_steps = FIRST_MERGE_STEPS
        """Overlap: apply a round's average this many steps after its boundary (waiting for it
        if needed), as the last result that said one said: the same on every cluster."""
        self._mark: float | None = None
        self._steps: dict[bool, list[float]] = {True: [0.0, 0], False: [0.0, 0]}

    def due(self, since: int) -> bool:
        """Whether a round is due after ``since`` steps since the last one. Time-based: a
        collective (call it on every rank after every step)."""
        if self.every_s is None:
            return since >= self.inner_steps
        flag = torch.zeros(1, dtype=torch.int32)
        if self._share.rank == 0:
            flag[0] = int(since >= 1 and self._training_s() >= self.every_s)
        self._share.broadcast(flag)
        return bool(flag.item())

    def info(self, since: int, samples_per_step: int) -> dict[str, float]:
        """What the cluster tells the relay with the contribution of a round due now."""
        out: dict[str, float] = {"weight": float(max(1, since) * max(1, samples_per_step))}
        if since > 0:
            out["step_s"] = max(self._training_s(), 1e-6) / since
        if self._last_cost is not None:
            out["comm_s"] = self._last_cost
        return out

    def pause(self, seconds: float) -> None:
        """``seconds`` since the last round were not training (overlap: a wait for a merge)."""
        self._paused += max(0.0, seconds)

    def restart(self, *, cost: float | None = None,
                next_round: NextRound | None = None) -> None:
        """Training goes on from now; ``cost``: what the round just ended kept the cluster from
        training; ``next_round``: what the round's result says of the next one (followed)."""
        self._since, self._paused = self._clock(), 0.0
        if cost is not None:
            self._last_cost = max(0.0, cost)
        if next_round is not None:
            self.follow(next_round)

    def follow(self, next_round: NextRound) -> None:
        """Take what a round's result said of the next round: its H (auto only), and with
        overlap the step at which its average is applied (what it does not say is kept)."""
        h, merge = next_round.h, next_round.merge
        if self.auto and h is not None and h >= 1:
            self.inner_steps = int(h)
        if merge is not None and merge >= 1:
            self.merge_steps = int(merge)

    def note_arrival(self, seconds: float) -> None:
        """Overlap (rank 0): the round in flight's average arrived ``seconds`` after its
        boundary (reported with the next round)."""
        self._arrive_s = max(1e-6, seconds)

    def take_arrival(self) -> dict[str, float]:
        """Overlap: ``{"arrive_s": ...}`` for the round starting now, once per arrival."""
        out = {} if self._arrive_s is None else {"arrive_s": self._arrive_s}
        self._arrive_s = None
        return out

    def note_cost(self, cost: float) -> None:
        """Overlap: a round in flight cost ``cost`` seconds end to end (reported next round)."""
        self._last_cost = max(0.0, cost)

    def step_done(self, in_flight: bool) -> None:
        """A training step ended (called first thing after it): its time since :meth:`mark`,
        counted as a step with a round in flight (overlap) or without."""
        if self._mark is not None:
            bucket = self._steps[in_flight]
            bucket[0] += self._clock() - self._mark
            bucket[1] += 1

    def mark(self) -> None:
        """The sync's own work after a step is done: the next step starts now."""
        self._mark = self._clock()

    def step_times(self) -> dict[str, float]:
        """Mean seconds per step (training only) with a round in flight and without, since the
        last call: what a round in flight costs the steps beside it (overlap's timeline)."""
        out = {f"step_s_{'in_flight' if k else 'idle'}": v[0] / v[1]
               for k, v in self._steps.items() if v[1]}
        self._steps = {True: [0.0, 0], False: [0.0, 0]}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"inner_steps": self.inner_steps, "merge_steps": self.merge_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        h = state.get("inner_steps")
        if self.auto and isinstance(h, int) and h >= 1:
            self.inner_steps = h
        k = state.get("merge_steps")
        if isinstance(k, int) and k >= 1:
            self.merge_steps = int(k)

    def _training_s(self) -> float:
        return self._clock() - self._since - self._paused
