"""Placement searches under one evaluation budget: nebula's hybrid genetic search, and the two
baselines the paper compares with (best of random partitions; local search alone).

The hybrid search follows the paper's (a population of balanced partitions, multi-point
crossover with rebalancing, Kernighan-Lin style local search on every offspring) and mends what
its published code does not do:

- seeding that does something: besides random partitions, the population starts from
  placements built from the network itself. Devices are ordered by a nearest-neighbour chain
  (nearby devices end up adjacent), then dealt into groups at every mixing level m dividing the
  stage count: runs of m x dp consecutive devices dealt round-robin into m groups (m = 1: each
  group a block of nearby devices, best for data parallelism; m = stages: each group a
  cross-section of the network, best for the pipeline);
- a steady-state population that keeps its best: the offspring replaces the worst member, and
  duplicates are never admitted;
- crossover on aligned parents: group labels are arbitrary, so the second parent's groups are
  renamed after the first's by largest overlap before the multi-point crossover, and the
  rebalancing moves surplus devices to the groups their other parent put them in first;
- local search on the real objective (see localsearch.py) rather than on pairwise gains only.

Every searcher is reproducible for a given seed and stops exactly at the budget (or at its time
limit, with the best so far). From scale.SCALE_FROM devices the hybrid search and the local-search
baseline take their steps as scale.py does (bounded moves of chosen devices, incremental scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nebula_cli.planner.costmodel import CostModel, PlanError
from nebula_cli.planner.evaluator import (
    Evaluator,
    Exhausted,
    Scored,
    SearchProgress,
    groups_of,
    key_of,
)
from nebula_cli.planner.localsearch import better, descend
from nebula_cli.planner.scale import at_scale, scale_hybrid, scale_local

POPULATION = 16
"""Members of the hybrid search's population."""
OFFSPRING_LS = 24
"""Evaluations one offspring's local search may spend."""
SEED_LS = 60
"""Evaluations the local search of one initial member may spend."""
STALE_LIMIT = 2000
"""Children in a row already scored before the search ends early (the space is exhausted)."""


@dataclass(frozen=True)
class SearchOutcome:
    """What a searcher found, with the evaluations it spent (<= budget)."""

    best: Scored
    evaluations: int
    trace: list[float]
    timed_out: bool = False


def _outcome(evaluator: Evaluator) -> SearchOutcome:
    if evaluator.best is None:
        raise PlanError(f"budget must be >= 1 evaluation, found {evaluator.budget}")
    return SearchOutcome(evaluator.best, evaluator.count, evaluator.trace, evaluator.timed_out)


def _random_labels(rng: np.random.Generator, stages: int, dp: int) -> np.ndarray:
    return rng.permutation(np.repeat(np.arange(stages), dp))


def _trivial(model: CostModel) -> bool:
    return model.task.stages == 1 or model.task.dp == 1


def random_search(model: CostModel, budget: int, seed: int = 0, *,
                  time_limit: float | None = None,
                  on_progress: SearchProgress | None = None) -> SearchOutcome:
    """Baseline: the best of `budget` random balanced partitions."""
    ev = Evaluator(model, budget, time_limit=time_limit, on_progress=on_progress)
    rng = np.random.default_rng(seed)
    t = model.task
    try:
        ev.score(_random_labels(rng, t.stages, t.dp))
        while not _trivial(model):
            ev.score(_random_labels(rng, t.stages, t.dp))
    except Exhausted:
        pass
    return _outcome(ev)


def local_search(model: CostModel, budget: int, seed: int = 0, *,
                 time_limit: float | None = None,
                 on_progress: SearchProgress | None = None) -> SearchOutcome:
    """Baseline: the swap local search from random partitions, restarted at each local optimum
    until the budget is spent (at scale: scale.scale_local)."""
    ev = Evaluator(model, budget, time_limit=time_limit, on_progress=on_progress)
    rng = np.random.default_rng(seed)
    t = model.task
    try:
        if at_scale(model):
            scale_local(ev, rng)
        start = ev.score(_random_labels(rng, t.stages, t.dp))
        while not _trivial(model):
            descend(ev, start, rng)
            start = ev.score(_random_labels(rng, t.stages, t.dp))
    except Exhausted:
        pass
    return _outcome(ev)


def hybrid_search(model: CostModel, budget: int, seed: int = 0, *,
                  population: int = POPULATION, seeded: bool = True,
                  time_limit: float | None = None,
                  on_progress: SearchProgress | None = None) -> SearchOutcome:
    """nebula's search: seeded population, aligned crossover, local search on every offspring
    (at scale: scale.scale_hybrid). `seeded=False` starts from random partitions only (for
    comparison). Stops at the budget or after `time_limit` seconds, with the best so far."""
    ev = Evaluator(model, budget, time_limit=time_limit, on_progress=on_progress)
    rng = np.random.default_rng(seed)
    t = model.task
    pop: list[Scored] = []
    try:
        if at_scale(model):
            starts = seed_labels(model) if seeded else []
            while len(starts) < population:
                starts.append(_random_labels(rng, t.stages, t.dp))
            scale_hybrid(ev, starts, rng, SEED_LS, OFFSPRING_LS)
        if _trivial(model):
            ev.score(seed_labels(model)[0])
            return _outcome(ev)
        starts = seed_labels(model) if seeded else []
        while len(starts) < population:
            starts.append(_random_labels(rng, t.stages, t.dp))
        for labels in starts:
            if ev.known(groups_of(labels, t.stages)) is None:
                _admit(pop, descend(ev, ev.score(labels), rng, max_evals=SEED_LS), population)
        stale = 0  # children in a row that were all scored before
        while stale < STALE_LIMIT:
            p1, p2 = _pick(pop, rng), _pick(pop, rng)
            child = crossover(p1.labels, p2.labels, t.stages, rng)
            if p1 is p2 or ev.known(groups_of(child, t.stages)) is not None:
                child = mutate(child, rng, swaps=1 + int(rng.integers(t.stages)))
            if ev.known(groups_of(child, t.stages)) is not None and stale >= STALE_LIMIT // 2:
                child = _random_labels(rng, t.stages, t.dp)
            if ev.known(groups_of(child, t.stages)) is not None:
                stale += 1  # a small space may be exhausted: stop before the budget then
                continue
            stale = 0
            scored = descend(ev, ev.score(child), rng, max_evals=OFFSPRING_LS)
            _admit(pop, scored, population)
    except Exhausted:
        pass
    return _outcome(ev)


def _pick(pop: list[Scored], rng: np.random.Generator) -> Scored:
    """Binary tournament."""
    a, b = rng.integers(len(pop), size=2)
    return pop[a] if better(pop[a], pop[b]) else pop[b]


def _admit(pop: list[Scored], cand: Scored, size: int) -> None:
    """Add cand unless it is already there; past `size`, drop the worst member."""
    key = key_of(cand.groups)
    if any(key_of(m.groups) == key for m in pop):
        return
    if len(pop) < size:
        pop.append(cand)
        return
    worst = max(range(len(pop)), key=lambda i: (pop[i].score, float(pop[i].evaluation
                                                                     .group_data.sum())))
    if better(cand, pop[worst]):
        pop[worst] = cand


# -- seeds ------------------------------------------------------------------------------------
def seed_labels(model: CostModel) -> list[np.ndarray]:
    """Structured starting partitions: a nearest-neighbour chain of the devices dealt into groups
    at every mixing level (m dividing the stage count), from two chain starts."""
    t = model.task
    n = t.devices
    mix = model.data_pair / max(model.data_pair.mean(), 1e-12) + \
        model.pipe_pair / max(model.pipe_pair.mean(), 1e-12)
    spread = mix.sum(axis=1)
    out: list[np.ndarray] = []
    seen: set[bytes] = set()
    for start in (int(np.argmax(spread)), int(np.argmin(spread))):
        chain = _chain(mix, start)
        for m in [m for m in range(1, t.stages + 1) if t.stages % m == 0]:
            labels = np.empty(n, dtype=int)
            block = m * t.dp
            for i, dev in enumerate(chain):
                labels[dev] = (i // block) * m + (i % block) % m
            key = key_of(groups_of(labels, t.stages))
            if key not in seen:
                seen.add(key)
                out.append(labels)
    return out


def _chain(cost: np.ndarray, start: int) -> list[int]:
    n = cost.shape[0]
    left = np.ones(n, dtype=bool)
    chain = [start]
    left[start] = False
    for _ in range(n - 1):
        row = np.where(left, cost[chain[-1]], np.inf)
        nxt = int(np.argmin(row))
        chain.append(nxt)
        left[nxt] = False
    return chain


# -- variation --------------------------------------------------------------------------------
def align(reference: np.ndarray, other: np.ndarray, stages: int) -> np.ndarray:
    """`other` with its group labels renamed to the reference's by largest overlap (greedy)."""
    overlap = np.zeros((stages, stages), dtype=int)
    np.add.at(overlap, (other, reference), 1)
    rename = np.full(stages, -1)
    used = np.zeros(stages, dtype=bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        src, dst = divmod(int(flat), stages)
        if rename[src] < 0 and not used[dst]:
            rename[src], used[dst] = dst, True
    return rename[other]


def crossover(p1: np.ndarray, p2: np.ndarray, stages: int,
              rng: np.random.Generator) -> np.ndarray:
    """Multi-point crossover of two label vectors after alignment, then rebalancing: devices of
    overfull groups move to underfull ones, those whose other parent chose an underfull group
    first."""
    q = align(p1, p2, stages)
    n = p1.size
    dp = n // stages
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, max(1, stages)), replace=False))
    take_second = np.zeros(n, dtype=bool)
    for i, (lo, hi) in enumerate(zip([0, *cuts.tolist()], [*cuts.tolist(), n], strict=True)):
        take_second[lo:hi] = bool(i % 2)
    perm = rng.permutation(n)  # cut points over a random device order, not the ids' order
    child = p1.copy()
    child[perm[take_second]] = q[perm[take_second]]
    alt = np.where(child == p1, q, p1)
    counts = np.bincount(child, minlength=stages)
    for dev in rng.permutation(n).tolist():
        g = child[dev]
        if counts[g] <= dp:
            continue
        if counts[alt[dev]] < dp:
            target = int(alt[dev])
        else:
            continue
        child[dev] = target
        counts[g] -= 1
        counts[target] += 1
    for dev in rng.permutation(n).tolist():
        g = child[dev]
        if counts[g] <= dp:
            continue
        target = int(np.flatnonzero(counts < dp)[0])
        child[dev] = target
        counts[g] -= 1
        counts[target] += 1
    return child


def mutate(labels: np.ndarray, rng: np.random.Generator, swaps: int) -> np.ndarray:
    """`swaps` random swaps of devices between groups."""
    out = labels.copy()
    n = out.size
    for _ in range(swaps):
        u, v = rng.integers(n, size=2)
        while out[u] == out[v]:
            u, v = rng.integers(n, size=2)
        out[u], out[v] = out[v], out[u]
    return out
