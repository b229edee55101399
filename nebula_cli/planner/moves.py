"""Which swaps to try at scale: bounds for swapping a few chosen devices with every other device.

`localsearch.swap_bounds` ranks all N^2 swaps (O(N^2 dp) work), too much above a few hundred
devices. Here the rows are a small set of devices worth moving: the members of the groups with the
largest data cost (the data bottleneck), the two ends of the costliest pair of every pipeline link
(the pipeline bottleneck), and a few at random. For each pair (u, v), u a chosen device and v any
device of another group, the bound is the same as swap_bounds' (see localsearch.py): the two
changed groups' data costs exactly (from the members' sums), every other group kept, and the
pipeline with the current order and matchings, u and v taking each other's partners. The work is
O(rows x N x dp), in blocks of at most BLOCK elements.
"""

from __future__ import annotations

import numpy as np

from nebula_cli.planner.costmodel import CostModel
from nebula_cli.planner.evaluator import Scored

BLOCK = 1 << 22
"""Elements per block of the data bound (memory cap)."""


def chosen_rows(model: CostModel, cur: Scored, rng: np.random.Generator, count: int,
                links: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Up to `count` devices to move: data bottleneck first, then the pipeline's, then random."""
    gd = cur.evaluation.group_data
    worst = np.argsort(-gd, kind="stable")
    picks: list[int] = []
    for g in worst[:2].tolist():  # the bottleneck group's members, largest sum first
        members = cur.groups[g]
        sums = model.data_pair[members[:, None], members[None, :]].sum(axis=1)
        picks.extend(members[np.argsort(-sums, kind="stable")].tolist())
    left, right = links
    picks.extend(left.tolist())
    picks.extend(right.tolist())
    picks.extend(rng.permutation(cur.labels.size)[:count].tolist())
    out = list(dict.fromkeys(picks))  # unique, first occurrence kept
    head = out[:max(1, count // 2)]
    rest = out[len(head):]
    extra = rng.permutation(len(rest))[:count - len(head)] if rest else []
    return np.array(head + [rest[i] for i in extra], dtype=np.int64)


def partners(model: CostModel, cur: Scored) -> tuple[np.ndarray, ...]:
    """Along the current pipeline: each device's previous and next partner (-1: none), each
    link's value, each link's costliest pair (left and right device), and each link's three
    costliest pair values and their left devices."""
    groups, order = cur.groups, cur.evaluation.order
    n = cur.labels.size
    prev_p, next_p = np.full(n, -1), np.full(n, -1)
    edges = len(order) - 1
    link_v = np.empty(edges)
    worst_l, worst_r = np.empty(edges, dtype=np.int64), np.empty(edges, dtype=np.int64)
    top_v, top_l = np.full((max(edges, 1), 3), -np.inf), np.full((max(edges, 1), 3), -2)
    for k in range(edges):
        left, right = groups[order[k]], groups[order[k + 1]]
        link_v[k], match = model.link(left.tolist(), right.tolist())
        right_m = right[match]
        next_p[left] = right_m
        prev_p[right_m] = left
        costs = model.pipe_pair[left, right_m]
        best = np.argsort(-costs, kind="stable")[:3]
        top_v[k, :best.size], top_l[k, :best.size] = costs[best], left[best]
        worst_l[k], worst_r[k] = left[best[0]], right_m[best[0]]
    return prev_p, next_p, link_v, worst_l, worst_r, top_v, top_l


def row_bounds(model: CostModel, cur: Scored, rows: np.ndarray,
               parts: tuple[np.ndarray, ...]) -> np.ndarray:
    """bound[i, v]: an estimate (upper bound while the pipeline order is kept) of the score
    after swapping rows[i] with v; +inf where not a swap (same group, or matched partners)."""
    labels, groups = cur.labels, cur.groups
    n, stages = labels.size, groups.shape[0]
    prev_p, next_p, link_v, _, _, top_v, top_l = parts
    cd, cp = model.data_pair, model.pipe_pair
    gd = cur.evaluation.group_data
    members = groups[labels]  # (n, dp)
    rowsum = cd[np.arange(n)[:, None], members].sum(axis=1)
    bound = np.empty((rows.size, n))
    dp = groups.shape[1]
    top = np.argsort(-gd, kind="stable")[:3]
    pos = np.empty(stages, dtype=np.int64)
    pos[cur.evaluation.order] = np.arange(stages)
    at = pos[labels]
    mv = members  # (n, dp): v's group, stayers w once u takes v's place
    base_v = rowsum[mv] - cd[mv, np.arange(n)[:, None]]
    base_v[mv == np.arange(n)[:, None]] = -np.inf
    step = max(1, BLOCK // (2 * dp * n))
    for lo in range(0, rows.size, step):
        u = rows[lo:lo + step]
        a = labels[u]
        # u's group with v in u's place: stayers w and v's own sum
        m = members[u]  # (k, dp)
        base = rowsum[m] - cd[m, u[:, None]]
        base[m == u[:, None]] = -np.inf
        grid = cd[m]  # (k, dp, n): cd[w, v]
        new_a = np.maximum((base[:, :, None] + grid).max(axis=1),
                           grid.sum(axis=1) - cd[u])
        cu = cd[u][:, mv]  # (k, n, dp): cd[u, w]
        new_b = np.maximum((base_v[None, :, :] + cu).max(axis=2),
                           cu.sum(axis=2) - cd[u])
        others = np.zeros((u.size, n))
        for t in top[::-1].tolist():
            others = np.where((a[:, None] != t) & (labels[None, :] != t), gd[t], others)
        data = np.maximum(np.maximum(new_a, new_b), others)
        pipe = _pipe_bound(cp, u, at, prev_p, next_p, link_v, top_v, top_l)
        b = data + 2 * pipe
        b[labels[None, :] == a[:, None]] = np.inf
        b[(next_p[u][:, None] == np.arange(n)[None, :]) |
          (prev_p[u][:, None] == np.arange(n)[None, :])] = np.inf
        bound[lo:lo + step] = b
    return bound


def _pipe_bound(cp: np.ndarray, u: np.ndarray, at: np.ndarray, prev_p: np.ndarray,
                next_p: np.ndarray, link_v: np.ndarray, top_v: np.ndarray,
                top_l: np.ndarray) -> np.ndarray:
    """Pipeline cost after swapping u (rows) with every v, order and matchings kept: only the
    links next to u's or v's stage change; each becomes the largest of its pairs that do not
    move (from its three costliest pairs) and the pairs u and v take over."""
    n, edges = at.size, link_v.size
    out = np.full((u.size, n), float(link_v.sum()))
    if edges == 0:
        return out
    uu, vv = u[:, None], np.arange(n)[None, :]
    au, av = at[u][:, None], at[None, :]
    for k_of, is_v in ((au - 1, False), (au, False), (av - 1, True), (av, True)):
        valid = (k_of >= 0) & (k_of < edges)
        if is_v:  # already counted when the link is also next to u
            valid = valid & (k_of != au - 1) & (k_of != au)
        k = np.clip(k_of, 0, edges - 1)
        out += np.where(valid, _link_after(cp, k, uu, vv, at, prev_p, next_p, top_v, top_l)
                        - link_v[k], 0.0)
    return out


def _link_after(cp: np.ndarray, k: np.ndarray, u: np.ndarray, v: np.ndarray, at: np.ndarray,
                prev_p: np.ndarray, next_p: np.ndarray, top_v: np.ndarray,
                top_l: np.ndarray) -> np.ndarray:
    """Link k after swapping u and v (pairs named by their left device): the pairs with u or v
    at one end are replaced, the rest bounded by the link's costliest pairs that stay."""
    moved = []
    parts = []
    for x, y in ((u, v), (v, u)):
        on_left, on_right = at[x] == k, at[x] == k + 1
        moved.append(np.where(on_left, x, -2))
        moved.append(np.where(on_right, prev_p[x], -2))
        parts.append(np.where(on_left, cp[y, np.maximum(next_p[x], 0)], -np.inf))
        parts.append(np.where(on_right, cp[np.maximum(prev_p[x], 0), y], -np.inf))
    rest = np.full(np.broadcast_shapes(k.shape, u.shape, v.shape), -np.inf)
    for t in range(top_v.shape[1]):
        left = top_l[k, t]
        stays = left != moved[0]
        for m in moved[1:]:
            stays = stays & (left != m)
        rest = np.maximum(rest, np.where(stays, top_v[k, t], -np.inf))
    new = parts[0]
    for part in parts[1:]:
        new = np.maximum(new, part)
    return np.maximum(rest, new)
