"""A lower bound on the score of any placement of a network's devices for a task, so a plan can
say how far from optimal it can at most be (`gap`).

score = data + 2 x pipeline. Three facts, each valid for every placement:

- data: device u's group holds u and dp - 1 other devices, so its cost is at least u's sum over
  its dp - 1 cheapest partners (data_pair); the largest of these over all devices, D, bounds the
  data cost.
- pipeline: every device of a group takes part in each link of its group (a perfect matching),
  so each link of group G costs at least m_u = u's cheapest pipe_pair, for every u in G. With M_G
  the largest m_u in G, a link costs at least max(M_G, M_H). Over a path, charge each link to its
  endpoint further from the path's cheapest group (a tree rooted there): the path costs at least
  the sum of all M_G but the smallest. Groups are not known, but the k-th largest M_G is at least
  the ((k - 1) dp + 1)-th largest m_u (the (k - 1) dp + 1 largest cannot share fewer than k
  groups); summing the stages - 1 largest of these gives P.
- sites: for a threshold tau, either data >= tau, or every group costs less than tau. Then two
  devices u, w share a group only if data_pair[u, w] plus u's dp - 2 cheapest other partners is
  below tau (and the same for w): groups lie inside the connected components of that
  "may share" graph. If a component's size is not a multiple of dp there is no such placement;
  otherwise with r components the pipeline crosses between components at least r - 1 times, each
  crossing at least the cheapest pipe_pair leaving a component, X, and the other links at least
  the smallest m_u. So score >= min(max(tau, D) + 2 P, D + 2 max(P, (r - 1) X + (stages - r)
  min m)) for every tau; the bound is the best over TAUS thresholds.

tests/planner/test_scale.py checks the bound against exhaustive search on tiny instances. It is
still loose where the best plans mix both costs (a few groups spanning two sites, say).
"""

from __future__ import annotations

import numpy as np

from nebula_cli.planner.costmodel import CostModel

BLOCK_ROWS = 512
"""Rows of the pair matrices handled at a time (memory cap)."""
TAUS = 24
"""Thresholds tried for the sites argument."""


def lower_bound(model: CostModel) -> float:
    """A score no placement of this network for this task can beat, in seconds."""
    t = model.task
    n = model.network.size
    data, rest, m = _device_bounds(model)
    pipeline = 0.0
    if t.stages > 1:
        ranked = np.sort(m)[::-1]
        pipeline = float(ranked[np.arange(t.stages - 1) * t.dp].sum())
    best = data + 2 * pipeline
    if t.stages == 1 or t.dp == 1 or n < 2:
        return best
    rng = np.random.default_rng(0)
    sample = rng.integers(n, size=(2, min(200_000, n * n)))
    share = model.data_pair[sample[0], sample[1]] + np.maximum(rest[sample[0]], rest[sample[1]])
    taus = np.unique(np.quantile(share[share > data], np.linspace(0, 1, TAUS))
                     if (share > data).any() else [])
    for tau in taus.tolist():
        a = max(tau, data) + 2 * pipeline
        if a <= best:
            continue
        comp = _components(model, rest, tau)
        sizes = np.bincount(comp)
        sizes = sizes[sizes > 0]
        if (sizes % t.dp).any():
            b = np.inf  # no placement has every group below tau
        else:
            r = sizes.size
            cross = _cheapest_crossing(model, comp) if r > 1 else 0.0
            b = data + 2 * max(pipeline, (r - 1) * cross + (t.stages - r) * float(m.min()))
        best = max(best, min(a, b))
    return best


def _device_bounds(model: CostModel) -> tuple[float, np.ndarray, np.ndarray]:
    """D, each device's sum over its dp - 2 cheapest data partners, and each m_u."""
    t = model.task
    n = model.network.size
    data = 0.0
    rest = np.zeros(n)
    m = np.zeros(n)
    for lo in range(0, n, BLOCK_ROWS):
        rows = np.arange(lo, min(n, lo + BLOCK_ROWS))
        if t.dp > 1:
            cd = model.data_pair[rows].copy()
            cd[np.arange(rows.size), rows] = np.inf  # not one's own partner
            part = np.sort(np.partition(cd, t.dp - 2, axis=1)[:, :t.dp - 1], axis=1)
            data = max(data, float(part.sum(axis=1).max()))
            rest[rows] = part[:, :t.dp - 2].sum(axis=1)
        cp = model.pipe_pair[rows].copy()
        cp[np.arange(rows.size), rows] = np.inf
        m[rows] = cp.min(axis=1) if n > 1 else 0.0
    return data, rest, m


def _components(model: CostModel, rest: np.ndarray, tau: float) -> np.ndarray:
    """Component labels of the graph "u and w may share a group with every group below tau"."""
    n = rest.size
    label = np.arange(n)
    while True:
        new = label.copy()
        for lo in range(0, n, BLOCK_ROWS):
            rows = slice(lo, min(n, lo + BLOCK_ROWS))
            share = model.data_pair[rows] + np.maximum(rest[rows, None], rest[None, :]) < tau
            share[np.arange(share.shape[0]), np.arange(lo, lo + share.shape[0])] = True
            new[rows] = np.where(share, label[None, :], n).min(axis=1)
        new = new[new]  # jump to the label's label
        if np.array_equal(new, label):
            return label
        label = new


def _cheapest_crossing(model: CostModel, comp: np.ndarray) -> float:
    """The cheapest pipe_pair between devices of different components."""
    n = comp.size
    best = np.inf
    for lo in range(0, n, BLOCK_ROWS):
        rows = slice(lo, min(n, lo + BLOCK_ROWS))
        other = comp[rows, None] != comp[None, :]
        best = min(best, float(np.where(other, model.pipe_pair[rows], np.inf).min()))
    return best


def gap(score: float, bound: float) -> float:
    """How much of the score a better plan could save at most: (score - bound) / score."""
    return 0.0 if score <= 0 else max(0.0, (score - bound) / score)
