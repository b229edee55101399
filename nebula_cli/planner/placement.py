"""`nebula plan placement` as a library call: search, the two baselines at the same budget, and a
result that says which device holds which stage of which replica."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nebula_cli.planner.costmodel import Cost, CostModel, DeviceId, Groups, Network, PlanError, Task
from nebula_cli.planner.search import hybrid_search, local_search, random_search

DEFAULT_BUDGET = 5000


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
            "evaluations": self.evaluations,
            "seconds": self.seconds,
            "budget": self.budget,
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
                   baselines: bool = True) -> PlacementResult:
    """Run nebula's search within `budget` evaluations; with `baselines`, also random search and
    local search alone at the same budget and seed."""
    if budget < 1:
        raise PlanError(f"budget must be >= 1 evaluation, found {budget}")
    model = CostModel(network, task)
    start = time.perf_counter()
    found = hybrid_search(model, budget, seed)
    seconds = time.perf_counter() - start
    placement = explain(model, found.best.groups.tolist())
    scores: dict[str, float | None] = {"random": None, "local_search": None}
    times: dict[str, float] = {}
    if baselines:
        for name, searcher in (("random", random_search), ("local_search", local_search)):
            t0 = time.perf_counter()
            scores[name] = searcher(model, budget, seed).best.score
            times[name] = time.perf_counter() - t0
    return PlacementResult(placement, found.evaluations, seconds, budget, seed, scores, times)
