"""The searches above SCALE_FROM devices, where scoring all N^2 swaps per step is out of reach.

Both keep their small-scale counterparts' plan (search.py) and change how a step is taken: a few
devices worth moving are chosen (the data bottleneck's members, the ends of each link's costliest
pair, some at random; moves.py), their swaps with every other device are bounded in one
vectorised pass, and the best-bounded swaps are scored incrementally (incremental.py), the first
that improves is taken, and the step goes on down the ranking.

- `scale_hybrid`: the structured seeds (search.seed_labels: group-by-location, striped and the
  mixing levels between) are scored, the best POPULATION_AT_SCALE improved by local search, then
  iterated local search: a member picked by tournament is kicked by a few random swaps (scored
  incrementally, each one evaluation) and improved; the result replaces the population's worst
  member if better.
- `scale_local`: the baseline, local search alone from random partitions, restarted at each local
  optimum.
"""

from __future__ import annotations

import numpy as np

from nebula_cli.planner.costmodel import CostModel
from nebula_cli.planner.evaluator import Evaluator, Scored, groups_of, key_of
from nebula_cli.planner.incremental import swapped
from nebula_cli.planner.localsearch import better
from nebula_cli.planner.moves import chosen_rows, partners, row_bounds

SCALE_FROM = 128
"""Devices from which the searches of this module are used."""
POPULATION_AT_SCALE = 4
"""Members kept by the iterated local search."""
ROW_ELEMENTS = 1_000_000
"""Work of one step's bounds: rows x devices x dp at most this (at least 8 rows)."""
TRIES = 8
PICK = 64
"""Best-bounded swaps one step goes through, in the order of its bounds, moving on from every
improvement (bounds of later swaps may be stale by then; the score is always exact) until TRIES
in a row fail."""
MAX_ROWS = 12
"""At most this many devices are chosen to move per step."""
"""Best-bounded swaps scored per step before giving up at a local optimum."""
KICK_SWAPS = 3
"""At most this many random swaps kick a member out of its local optimum."""


def scale_descend(ev: Evaluator, start: Scored, rng: np.random.Generator, *,
                  max_evals: int | None = None) -> Scored:
    """Improve `start` by single swaps of chosen devices until no tried swap improves (or
    `max_evals` are spent). Raises Exhausted with the budget or the time."""
    model, cur, spent = ev.model, start, 0
    n, dp = start.labels.size, model.task.dp
    count = max(8, min(MAX_ROWS, ROW_ELEMENTS // (n * dp)))
    while True:
        parts = partners(model, cur)
        rows = chosen_rows(model, cur, rng, count, (parts[3], parts[4]))
        bound = row_bounds(model, cur, rows, parts)
        flat = (bound + 1e-9 * rng.random(bound.shape)).ravel()
        finite = int(np.isfinite(flat).sum())
        if finite == 0:
            return cur
        pick = min(PICK, finite)
        best = np.argpartition(flat, pick - 1)[:pick]
        failed, moved = 0, False
        for i in best[np.argsort(flat[best])].tolist():
            r, v = divmod(i, n)
            u = int(rows[r])
            if not np.isfinite(flat[i]) or cur.labels[u] == cur.labels[v]:
                continue  # (a move taken in this step may have joined them)
            if ev.seen.get(key_of(swapped(cur.labels, cur.groups, u, v)[1])) is not None:
                continue
            cand = ev.score_swap(cur, u, v)
            spent += 1
            if better(cand, cur):
                cur, moved, failed = cand, True, 0
            else:
                failed += 1
            if (max_evals is not None and spent >= max_evals) or failed >= TRIES:
                break
        if not moved or (max_evals is not None and spent >= max_evals):
            return cur


def kick(ev: Evaluator, member: Scored, rng: np.random.Generator) -> Scored:
    """A few random swaps between different groups, each scored incrementally."""
    cur = member
    n = cur.labels.size
    for _ in range(1 + int(rng.integers(KICK_SWAPS))):
        u, v = (int(x) for x in rng.integers(n, size=2))
        while cur.labels[u] == cur.labels[v]:
            u, v = (int(x) for x in rng.integers(n, size=2))
        cur = ev.score_swap(cur, u, v)
    return cur


def scale_hybrid(ev: Evaluator, seeds: list[np.ndarray], rng: np.random.Generator,
                 seed_evals: int, offspring_evals: int) -> None:
    """nebula's search at scale (see the module docstring); the evaluator keeps the best."""
    t = ev.model.task
    scored = []
    for labels in seeds:
        if ev.seen.get(key_of(groups_of(labels, t.stages))) is None:
            scored.append(ev.score(labels))
    scored.sort(key=lambda s: s.score)
    pop: list[Scored] = []
    for s in scored[:POPULATION_AT_SCALE]:
        _admit(pop, scale_descend(ev, s, rng, max_evals=seed_evals))
    while True:
        a, b = rng.integers(len(pop), size=2)
        parent = pop[a] if better(pop[a], pop[b]) else pop[b]
        child = scale_descend(ev, kick(ev, parent, rng), rng, max_evals=offspring_evals)
        _admit(pop, child)


def scale_local(ev: Evaluator, rng: np.random.Generator) -> None:
    """Local search alone from random partitions, restarted at each local optimum."""
    t = ev.model.task
    while True:
        start = ev.score(rng.permutation(np.repeat(np.arange(t.stages), t.dp)))
        scale_descend(ev, start, rng)


def _admit(pop: list[Scored], cand: Scored) -> None:
    key = key_of(cand.groups)
    if any(key_of(m.groups) == key for m in pop):
        return
    if len(pop) < POPULATION_AT_SCALE:
        pop.append(cand)
        return
    worst = max(range(len(pop)), key=lambda i: pop[i].score)
    if better(cand, pop[worst]):
        pop[worst] = cand


def at_scale(model: CostModel) -> bool:
    """Whether the searches of this module apply."""
    return model.network.size >= SCALE_FROM and model.task.stages > 1 and model.task.dp > 1
