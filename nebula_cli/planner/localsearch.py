"""Swap local search, Kernighan-Lin style: rank every swap of two devices by a cheap bound, score
only the best few, move to the first that improves.

The bound for swapping u and v keeps the current pipeline order and the current replica matching
(which can only be re-optimised afterwards, so never make the cost worse): the data cost of the
two changed groups is exact (from each member's sum), every other group keeps its cost, and each
pipeline link next to a changed group becomes the largest of its untouched pairs and the pairs
that u and v take over. The bound is an upper bound of the true score, so a swap whose bound is
below the current score is an improvement for certain; it is scored anyway and counted, like
every candidate whose score is computed. Computing bounds is not counted (the paper's
Kernighan-Lin gains are not either).

Ties are broken by the sum of all groups' data costs (slack in groups that are not the
bottleneck), which lets the search walk across the plateaus a max-of-costs objective has.
"""

from __future__ import annotations

import numpy as np

from nebula_cli.planner.costmodel import CostModel
from nebula_cli.planner.evaluator import Evaluator, Scored, groups_of
from nebula_cli.planner.moves import partners

EPS = 1e-9
_CHUNK = 1 << 22  # elements per block of the data bound (memory cap)


def soft(scored: Scored) -> float:
    """The tie-breaker: the sum of every group's data cost."""
    return float(scored.evaluation.group_data.sum())


def better(a: Scored, b: Scored) -> bool:
    """a beats b: a lower score, or the same score with more slack."""
    return a.score < b.score - EPS or (a.score <= b.score + EPS and soft(a) < soft(b) - EPS)


def swap_bounds(model: CostModel, cur: Scored) -> tuple[np.ndarray, np.ndarray]:
    """(bound, slack change) for swapping devices u < v of different groups, as N x N arrays;
    +inf where the swap is not considered (same group, u >= v, or u and v matched replicas)."""
    labels, groups, ev = cur.labels, cur.groups, cur.evaluation
    n, (stages, dp) = labels.size, groups.shape
    idx = np.arange(n)
    if stages == 1 or dp == 1:  # one partition only
        return np.full((n, n), np.inf), np.zeros((n, n))
    data_new, data_delta = _data_bounds(model.data_pair, labels, groups, ev.group_data)
    pipe_new, mutual = _pipeline_bounds(model, cur)
    bound = data_new + 2 * pipe_new
    bad = (labels[:, None] == labels[None, :]) | (idx[:, None] >= idx[None, :]) | mutual
    bound[bad] = np.inf
    return bound, data_delta


def _data_bounds(cd: np.ndarray, labels: np.ndarray, groups: np.ndarray,
                 group_data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n, stages = labels.size, groups.shape[0]
    members = groups[labels]  # (n, dp): the members of u's group
    rowsum = cd[np.arange(n)[:, None], members].sum(axis=1)
    # new cost of u's group once v replaces u: max over stayers w of rowsum[w] - cd[w,u] +
    # cd[w,v], and v's own sum over the stayers
    new_a = np.empty((n, n))
    step = max(1, _CHUNK // (members.shape[1] * n))
    for lo in range(0, n, step):
        u = np.arange(lo, min(n, lo + step))
        m = members[u]
        base = rowsum[m] - cd[m, u[:, None]]
        base[m == u[:, None]] = -np.inf
        grid = cd[m]  # (k, dp, n): cd[w, v]
        stay = (base[:, :, None] + grid).max(axis=1)
        joined = grid.sum(axis=1) - cd[u]
        new_a[u] = np.maximum(stay, joined)
    new_b = new_a.T
    # the largest data cost among the groups neither swap touches
    top = np.argsort(-group_data)[:3]
    ga = np.arange(stages)[:, None]
    gb = np.arange(stages)[None, :]
    others = np.zeros((stages, stages))
    for t in top[::-1]:  # the first of the top three that is neither group wins
        others = np.where((ga != t) & (gb != t), group_data[t], others)
    new = np.maximum(np.maximum(new_a, new_b), others[labels][:, labels])
    delta = new_a + new_b - group_data[labels][:, None] - group_data[labels][None, :]
    return new, delta


def _pipeline_bounds(model: CostModel, cur: Scored) -> tuple[np.ndarray, np.ndarray]:
    """Bound on the pipeline cost after each swap, and the mask of matched replica pairs.

    Swapping u (stage a) and v (stage b) touches the links a-1, a, b-1, b. For |a - b| >= 2
    these are disjoint and the change splits into f[u, v] (v in u's place) + f[v, u]; for
    adjacent stages the shared link loses both pairs and gains the two new ones."""
    cp, labels, groups, ev = model.pipe_pair, cur.labels, cur.groups, cur.evaluation
    n, stages = labels.size, groups.shape[0]
    order = ev.order
    pos = np.empty(stages, dtype=int)
    pos[order] = np.arange(stages)
    at = pos[labels]
    edges = stages - 1
    prev_p, next_p, link_v, _, _, top_v, top_i = partners(model, cur)
    has_prev, has_next = at >= 1, at <= edges - 1
    k_prev, k_next = np.clip(at - 1, 0, edges - 1), np.clip(at, 0, edges - 1)
    # each link's largest pair without x's own pair (pairs are named by their left device)
    rest_prev = np.where(top_i[k_prev, 0] == prev_p, top_v[k_prev, 1], top_v[k_prev, 0])
    rest_next = np.where(top_i[k_next, 0] == np.arange(n), top_v[k_next, 1], top_v[k_next, 0])
    cp_prev = cp[np.maximum(prev_p, 0)]  # [x, v]: v paired with x's previous partner
    cp_next = cp[np.maximum(next_p, 0)]
    f_prev = np.where(has_prev[:, None],
                      np.maximum(rest_prev[:, None], cp_prev) - link_v[k_prev][:, None], 0.0)
    f_next = np.where(has_next[:, None],
                      np.maximum(rest_next[:, None], cp_next) - link_v[k_next][:, None], 0.0)
    f = f_prev + f_next
    delta = f + f.T
    # adjacent stages: u at a, v at a + 1 (not matched to each other)
    u, v = np.nonzero(at[None, :] == at[:, None] + 1)
    keep = next_p[u] != v
    u, v = u[keep], v[keep]
    a = at[u]
    ids, vals = top_i[a], top_v[a]
    rest = np.where((ids != u[:, None]) & (ids != prev_p[v][:, None]), vals, -np.inf).max(axis=1)
    shared = np.maximum(rest, np.maximum(cp[v, next_p[u]], cp[prev_p[v], u])) - link_v[a]
    adjacent = f_prev[u, v] + shared + f_next[v, u]
    delta[u, v] = adjacent
    delta[v, u] = adjacent
    mutual = (next_p[:, None] == np.arange(n)[None, :]) | (prev_p[:, None] == np.arange(n))
    return float(link_v.sum()) + delta, mutual


def descend(evaluator: Evaluator, start: Scored, rng: np.random.Generator, *,
            max_evals: int | None = None, tries: int = 4) -> Scored:
    """Improve `start` by single swaps until none of the `tries` best-bounded swaps improves
    (or `max_evals` evaluations are spent). Raises Exhausted with the budget; the evaluator
    keeps the best candidate seen either way."""
    model, cur, spent = evaluator.model, start, 0
    n, stages = start.labels.size, start.groups.shape[0]
    while True:
        bound, delta = swap_bounds(model, cur)
        rank = bound + 1e-3 * delta + 1e-9 * rng.random(bound.shape)
        flat = rank.ravel()
        finite = int(np.isfinite(flat).sum())
        if finite == 0:
            return cur
        pick = min(4 * tries, finite)
        best = np.argpartition(flat, pick - 1)[:pick]
        best = best[np.argsort(flat[best])]
        tried = 0
        moved = False
        for i in best.tolist():
            u, v = divmod(i, n)
            labels = cur.labels.copy()
            labels[u], labels[v] = labels[v], labels[u]
            if evaluator.known(groups_of(labels, stages)) is not None:
                continue
            cand = evaluator.score(labels)
            spent += 1
            tried += 1
            if better(cand, cur):
                cur, moved = cand, True
                break
            if (max_evals is not None and spent >= max_evals) or tried >= tries:
                break
        if not moved or (max_evals is not None and spent >= max_evals):
            return cur
