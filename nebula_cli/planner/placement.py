"""`nebula plan placement` as a library call: search, the two baselines, a lower bound, and a
result that says which device holds which stage of which replica.

Baselines: "random" is the best of RANDOM_BASELINE random balanced placements; "local_search"
is local search alone at the same budget and time limit as nebula's search."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nebula_cli.planner.bounds import gap, lower_bound
from nebula_cli.planner.costmodel import Cost, CostModel, DeviceId, Groups, Network, PlanError, Task
from nebula_cli.planner.search import hybrid_search, local_search, random_search

DEFAULT_BUDGET = 5000
"""Evaluations per search (the paper's)."""
RANDOM_BASELINE = 100
"""Random balanced placements the random baseline draws."""

PhaseProgress = Callable[[str, int, int, float, float], None]
"""on_progress(phase, evaluations, budget, best score, seconds elapsed in the phase); phases:
"nebula", "random", "local_search"."""


@dataclass(frozen=True)
class Placement:
    """Stages in pipeline order, replica-aligned: ``stages[j][r]`` is the device that holds stage
    j of replica r, and it sends its activations to ``stages[j + 1][r]`` (the bottleneck
    matching). ``links_s[j]``: the cost of the link between stage j and j + 1; ``data_s[j]``:
    stage j's data-parallel cost."""

    stages: list[list[DeviceId]]
    links_s: list[float]
    data_s: list[float]
    cost: Cost

    @property
    def replicas(self) -> list[list[DeviceId]]:
        """Replica r's devices, stage by stage."""
        return [list(r) for r in zip(*self.stages, strict=True)]


@dataclass(frozen=True)
class PlacementResult:
    """nebula's placement, what the baselines reached with the same budget, and the effort."""

    placement: Placement
    evaluations: int
    seconds: float
    budget: int
    seed: int
    baselines: dict[str, float | None] = field(default_factory=dict)
    """Best score of each baseline ("random", "local_search"); None when not run."""
    baseline_seconds: dict[str, float] = field(default_factory=dict)
    baseline_evaluations: dict[str, int] = field(default_factory=dict)
    lower_bound: float = 0.0
    """No placement scores below this (bounds.py)."""
    time_limit: float | None = None
    timed_out: bool = False
    """The search stopped at the time limit, before the budget."""

    @property
    def gap(self) -> float:
        """(score - lower bound) / score: the share of the score a better plan could save."""
        return gap(self.placement.cost.score, self.lower_bound)

    @property
    def evaluations_per_s(self) -> float:
        return self.evaluations / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The `--json` object."""
        p = self.placement
        return {
            "stages": p.stages,
            "score_s": p.cost.score,
            "data_cost_s": p.cost.data,
            "pipeline_cost_s": p.cost.pipeline,
            "links_s": p.links_s,
            "baselines": dict(self.baselines),
            "baseline_evaluations": dict(self.baseline_evaluations),
            "lower_bound_s": self.lower_bound,
            "gap": self.gap,
            "evaluations": self.evaluations,
            "evaluations_per_s": self.evaluations_per_s,
            "seconds": self.seconds,
            "budget": self.budget,
            "time_limit_s": self.time_limit,
            "timed_out": self.timed_out,
            "seed": self.seed,
        }


def explain(model: CostModel, groups: Groups) -> Placement:
    """Order the groups along the cheapest pipeline and align every stage's replicas with the
    previous stage's through the bottleneck matchings."""
    model.check_partition(groups)
    ev = model.evaluate(groups)
    ids = model.network.devices
    current = list(groups[ev.order[0]])
    stages = [current]
    links = []
    for j in ev.order[1:]:
        value, match = model.link(current, list(groups[j]))
        current = [groups[j][match[i]] for i in range(len(current))]
        stages.append(current)
        links.append(value)
    data = [float(ev.group_data[j]) for j in ev.order]
    return Placement([[ids[int(d)] for d in s] for s in stages], links, data, ev.cost)


def plan_placement(network: Network, task: Task, *, budget: int = DEFAULT_BUDGET, seed: int = 0,
                   baselines: bool = True, time_limit: float | None = None,
                   on_progress: PhaseProgress | None = None) -> PlacementResult:
    """Run nebula's search within `budget` evaluations (and `time_limit` seconds, if given);
    with `baselines`, also the best of RANDOM_BASELINE random placements and local search alone
    at the same budget, time limit and seed."""
    if budget < 1:
        raise PlanError(f"budget must be >= 1 evaluation, found {budget}")
    if time_limit is not None and not time_limit > 0:
        raise PlanError(f"time limit must be > 0 seconds, found {time_limit}")
    model = CostModel(network, task)
    bound = lower_bound(model)

    def report(phase: str, total: int) -> Callable[[int, float, float], None] | None:
        if on_progress is None:
            return None
        return lambda count, best, secs: on_progress(phase, count, total, best, secs)

    start = time.perf_counter()
    found = hybrid_search(model, budget, seed, time_limit=time_limit,
                          on_progress=report("nebula", budget))
    seconds = time.perf_counter() - start
    placement = explain(model, found.best.groups.tolist())
    scores: dict[str, float | None] = {"random": None, "local_search": None}
    times: dict[str, float] = {}
    counts: dict[str, int] = {}
    if baselines:
        runs = (("random", min(budget, RANDOM_BASELINE), random_search),
                ("local_search", budget, local_search))
        for name, evals, searcher in runs:
            t0 = time.perf_counter()
            out = searcher(model, evals, seed, time_limit=time_limit,
                           on_progress=report(name, evals))
            scores[name], counts[name] = out.best.score, out.evaluations
            times[name] = time.perf_counter() - t0
    return PlacementResult(placement, found.evaluations, seconds, budget, seed, scores, times,
                           counts, bound, time_limit, found.timed_out)
