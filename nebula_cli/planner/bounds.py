"""A lower bound on the score of any placement of a network's devices for a task, so a plan can
say how far from optimal it can at most be (`gap`).

score = data + 2 x pipeline, and each part is bounded on its own:

- data: device u's group holds u and dp - 1 other devices, so its cost is at least u's sum over
  its dp - 1 cheapest partners (data_pair); the largest of these over all devices is a bound.
- pipeline: every device of a group takes part in each link of its group (a perfect matching),
  so each link of group G costs at least m_u = u's cheapest pipe_pair to another device, for
  every u in G. With M_G the
  largest m_u in G, a link costs at least max(M_G, M_H). Over a path, charge each link to its
  endpoint further from the path's cheapest group (a tree rooted there): the path costs at least
  the sum of all M_G but the smallest. Groups are not known, but the k-th largest M_G is at least
  the ((k - 1) dp + 1)-th largest m_u (the (k - 1) dp + 1 largest cannot share fewer than k
  groups); summing the stages - 1 largest of these bounds the pipeline.

tests/test_planner_scale.py checks the bound against exhaustive search on tiny instances. On the
paper's two cases it is 9.128 s (two data centres, best known 12.266 s: gap 0.26) and 27.44 s
(regional US, optimum 31.4186 s: gap 0.13). It ignores that a pipeline cheap inside sites forces
groups spread over sites (and the other way round), so on networks of a few far-apart sites the
gap it prints is mostly the bound's own slack.
"""

from __future__ import annotations

import numpy as np

from nebula_cli.planner.costmodel import CostModel

BLOCK_ROWS = 512
"""Rows of the pair matrices sorted at a time (memory cap)."""


def lower_bound(model: CostModel) -> float:
    """A score no placement of this network for this task can beat, in seconds."""
    t = model.task
    n = model.network.size
    data = 0.0
    m = np.zeros(n)
    for lo in range(0, n, BLOCK_ROWS):
        rows = np.arange(lo, min(n, lo + BLOCK_ROWS))
        if t.dp > 1:
            cd = model.data_pair[rows].copy()
            cd[np.arange(rows.size), rows] = np.inf  # not one's own partner
            part = np.partition(cd, t.dp - 2, axis=1)[:, :t.dp - 1]
            data = max(data, float(part.sum(axis=1).max()))
        if t.stages > 1:
            cp = model.pipe_pair[rows].copy()
            cp[np.arange(rows.size), rows] = np.inf
            m[rows] = cp.min(axis=1)
    pipeline = 0.0
    if t.stages > 1:
        ranked = np.sort(m)[::-1]
        pipeline = float(ranked[np.arange(t.stages - 1) * t.dp].sum())
    return data + 2 * pipeline


def gap(score: float, bound: float) -> float:
    """How much of the score a better plan could save at most: (score - bound) / score."""
    return 0.0 if score <= 0 else max(0.0, (score - bound) / score)
