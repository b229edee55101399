"""The two combinatorial pieces of the cost model, usable on their own: the bottleneck perfect
matching of two groups (which replica sends to which) and the cheapest open path through all
groups (the pipeline order)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

EXACT_TOUR_MAX = 12
"""Stage counts up to this get an exact open tour (Held-Karp, 3 ms at 12 stages, 18 ms at 14);
above, a heuristic tour (see `_heuristic_tour`; its gap on exactly solved instances is pinned in
tests/planner/test_scale.py)."""
TOUR_STARTS = 2
OR_OPT_MAX = 2
"""Longest run of nodes an Or-opt move relocates."""
"""Nearest-neighbour paths the heuristic tour improves (the cheapest ones)."""


def bottleneck_matching(cost: np.ndarray) -> tuple[float, list[int]]:
    """Minimise the largest cost of a perfect matching of a square matrix's rows and columns.

    Returns (value, match) with row i matched to column match[i]. All entries up to the lower
    bound max(row minima, column minima) go in first; then entries in increasing order, each
    followed by a search for an augmenting path, until the matching is perfect (bitmask rows,
    Kuhn's augmenting paths).
    """
    n = cost.shape[0]
    if n == 1:
        return float(cost[0, 0]), [0]
    lower, masks = stacked_lower_bounds(cost[None])
    return bottleneck_from_bound(cost, float(lower[0]), masks[0])


def stacked_lower_bounds(blocks: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
    """For a stack of square matrices: each one's lower bound (max of row minima and column
    minima) and the bitmask rows of its entries up to that bound."""
    lower = np.maximum(blocks.min(axis=2).max(axis=1), blocks.min(axis=1).max(axis=1))
    allowed = blocks <= lower[:, None, None]
    n = blocks.shape[1]
    if n > 62:
        packed = np.packbits(allowed, axis=2, bitorder="little")
        masks = [[int.from_bytes(row.tobytes(), "little") for row in block] for block in packed]
    else:
        masks = (allowed * _bit_weights(n)).sum(axis=2).tolist()
    return lower, masks


def bottleneck_from_bound(cost: np.ndarray, lower: float, rows: list[int],
                          start: list[int] | None = None) -> tuple[float, list[int]]:
    """bottleneck_matching given the lower bound and the bitmask rows of entries <= it.
    `start` (row -> column or -1) is a matching to begin from, e.g. a neighbour's: its pairs
    up to the bound are kept, the other rows are matched greedily, then augmented."""
    n = cost.shape[0]
    rows = list(rows)
    mate = [-1] * n  # row -> column
    owner = [-1] * n  # column -> row

    def augment(r: int, seen: list[int]) -> bool:
        free = rows[r] & ~seen[0]
        while free:
            low = free & -free
            c = low.bit_length() - 1
            seen[0] |= low
            if owner[c] < 0 or augment(owner[c], seen):
                owner[c], mate[r] = r, c
                return True
            free &= ~seen[0]
        return False

    def phase() -> tuple[int, int]:
        """Augment from every free row once: (new pairs, columns reached if none was found)."""
        seen, found = [0], 0
        for r in range(n):
            if mate[r] < 0 and augment(r, seen):
                found += 1
                seen = [0]
        return found, seen[0]

    def grow(col: int) -> bool:
        """Column `col` just became reachable: extend the reached sets; True if that reaches
        a free column (an augmenting path exists)."""
        nonlocal reach_rows, reach_cols
        stack = [col]
        while stack:
            c = stack.pop()
            if (reach_cols >> c) & 1:
                continue
            reach_cols |= 1 << c
            if owner[c] < 0:
                return True
            reach_rows |= 1 << owner[c]
            new = rows[owner[c]] & ~reach_cols
            while new:
                low = new & -new
                stack.append(low.bit_length() - 1)
                new ^= low
        return False

    def search() -> int:
        """Augment while possible; then remember what alternating paths from free rows reach."""
        nonlocal reach_rows, reach_cols
        found = 0
        while True:  # until a phase finds nothing: its columns are all that free rows reach
            more, cols = phase()
            found += more
            if not more or -1 not in mate:
                break
        reach_cols = cols
        reach_rows = sum(1 << r for r in range(n) if mate[r] < 0)
        for c in range(n):
            if (cols >> c) & 1:
                reach_rows |= 1 << owner[c]
        return found

    reach_rows = reach_cols = 0
    taken = 0
    if start is not None:
        for r, c in enumerate(start):
            if c >= 0 and (rows[r] >> c) & 1 and not (taken >> c) & 1:
                mate[r], owner[c] = c, r
                taken |= 1 << c
    for r in range(n):  # greedy start
        if mate[r] >= 0:
            continue
        free = rows[r] & ~taken
        if free:
            low = free & -free
            c = low.bit_length() - 1
            mate[r], owner[c] = c, r
            taken |= low
    size = n - mate.count(-1)
    if size < n:
        size += search()
    if size == n:
        return lower, mate
    flat = cost.ravel()
    order = np.argsort(flat, kind="stable")
    ranked = flat[order]
    start = int(np.searchsorted(ranked, lower, side="right"))
    value = lower
    for e, entry in zip(order[start:].tolist(), ranked[start:].tolist(), strict=True):
        value = entry
        r, c = divmod(e, n)
        rows[r] |= 1 << c
        # an augmenting path through (r, c) needs r reachable and c leading to a free column
        if (reach_rows >> r) & 1 and not (reach_cols >> c) & 1 and grow(c):
            size += search()
            if size == n:
                break
    return value, mate


@lru_cache(maxsize=64)
def _bit_weights(n: int) -> np.ndarray:
    return 1 << np.arange(n, dtype=np.int64)


def open_tour(links: np.ndarray) -> tuple[float, list[int]]:
    """Cheapest open path visiting every node once: (cost, order). Exact (Held-Karp over
    subsets, size by size) up to EXACT_TOUR_MAX nodes; a deterministic heuristic above."""
    d = links.shape[0]
    if d == 1:
        return 0.0, [0]
    if d > EXACT_TOUR_MAX:
        return _heuristic_tour(links)
    sizes, where, steps = _tour_plan(d)
    lt = links.T
    # best[s][i, j]: cheapest path through the i-th set of s + 1 nodes, ending at node j
    cur = np.full((d, d), np.inf)
    cur[np.arange(d), np.arange(d)] = 0.0
    best = [cur]
    for size, (rows, ends, target) in zip(sizes[2:], steps, strict=True):
        ext = (cur[:, None, :] + lt[None, :, :]).min(axis=2)  # [set, k]: extended by k
        nxt = np.full(size * d, np.inf)
        nxt[target] = ext[rows, ends]
        cur = nxt.reshape(size, d)
        best.append(cur)
    end = int(np.argmin(cur[0]))
    cost = float(cur[0, end])
    order = [end]
    mask = (1 << d) - 1
    for layer in range(d - 2, -1, -1):
        mask ^= 1 << order[-1]
        prev = best[layer][where[mask]] + links[:, order[-1]]
        order.append(int(np.argmin(prev)))
    return cost, order[::-1]


@lru_cache(maxsize=20)
def _tour_plan(d: int) -> tuple[list[int], np.ndarray, list[tuple[np.ndarray, ...]]]:
    """Sets of nodes by size: how many of each size, each set's index among its size, and per
    size (set, node not in it) -> flat index of the extended set and that node, one size up."""
    pop = np.array([bin(m).count("1") for m in range(1 << d)])
    masks = np.arange(1 << d)
    layers = [masks[pop == s] for s in range(d + 1)]
    where = np.empty(1 << d, dtype=np.int64)
    for layer in layers:
        where[layer] = np.arange(layer.size)
    bits = 1 << np.arange(d)
    steps = []
    for s in range(1, d):
        rows, ends = np.nonzero((layers[s][:, None] & bits[None, :]) == 0)
        steps.append((rows, ends, where[layers[s][rows] | bits[ends]] * d + ends))
    return [layer.size for layer in layers], where, steps


def _heuristic_tour(links: np.ndarray) -> tuple[float, list[int]]:
    """Nearest-neighbour paths from every start; the TOUR_STARTS cheapest improved by 2-opt and
    Or-opt moves (best improvement first) to a local optimum. Deterministic: a function of the
    link matrix only, so a partition's score does not depend on how it was reached."""
    d = links.shape[0]
    paths = np.empty((d, d), dtype=np.int64)
    paths[:, 0] = np.arange(d)
    used = np.eye(d, dtype=bool)
    rows = np.arange(d)
    for k in range(1, d):
        nxt = np.where(used, np.inf, links[paths[:, k - 1]]).argmin(axis=1)
        paths[:, k] = nxt
        used[rows, nxt] = True
    costs = links[paths[:, :-1], paths[:, 1:]].sum(axis=1)
    best, best_order = math.inf, list(range(d))
    for i in np.argsort(costs, kind="stable")[:TOUR_STARTS].tolist():
        order = _improve_path(links, paths[i])
        cost = path_cost(links, order)
        if cost < best:
            best, best_order = cost, order
    return best, best_order


def _improve_path(links: np.ndarray, path: np.ndarray) -> list[int]:
    """2-opt (reverse p[i..j]) and Or-opt (move a run of 1-3 nodes, maybe reversed, between
    two other neighbours or to an end) on an open path, the best move first, until none
    improves."""
    p = path.copy()
    d = p.size
    lower = ~np.triu(np.ones((d, d), dtype=bool), 1)
    steps = (np.arange(d - 1), np.arange(1, d))
    two = np.empty((d, d))
    while True:
        q = links[p][:, p]
        e = q[steps]
        two[0] = 0.0
        two[1:] = q[:-1, :] - e[:, None]
        two[:, :-1] += q[:, 1:] - e[None, :]
        two[lower] = np.inf
        flat = int(np.argmin(two))
        gain, move = float(two.flat[flat]), ("2opt", *divmod(flat, d))
        for s in range(1, min(OR_OPT_MAX, d - 1) + 1):
            delta, how = _or_opt(q, e, s)
            k = int(np.argmin(delta))
            if delta.flat[k] < gain:
                gain, move = float(delta.flat[k]), ("or", s, *divmod(k, delta.shape[1]), how)
        if gain >= -1e-12 * max(1.0, float(e.sum())):
            return p.tolist()
        if move[0] == "2opt":
            i, j = move[1], move[2]
            p[i:j + 1] = p[i:j + 1][::-1].copy()
        else:
            p = _relocate(p, *move[1:])


def _or_opt(q: np.ndarray, e: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Change of cost for moving the run p[i..i+s-1] (rows i) after position k (columns
    k = -1..d-1, shifted by one: column 0 is the front), the better of forward and reversed;
    and which of the two (True: reversed)."""
    f, last, prev, nxt, w_prev, w_next, w_both, kk, k1, w_k, w_k1, ek, w_e, invalid = \
        _or_plan(q.shape[0], s)
    removed = w_prev * q[prev, f] + w_next * q[last, nxt] - w_both * q[prev, nxt]
    edge = w_e * e[ek]
    fc, lc = f[:, None], last[:, None]
    fwd = w_k * q[kk, fc] + w_k1 * q[lc, k1] - edge
    rev = w_k * q[kk, lc] + w_k1 * q[fc, k1] - edge
    how = rev < fwd
    delta = np.minimum(fwd, rev) - removed[:, None]
    delta[invalid] = np.inf
    return delta, how


@lru_cache(maxsize=256)
def _or_plan(d: int, s: int) -> tuple[np.ndarray, ...]:
    """The index arrays and 0/1 weights of `_or_opt` for a path of d nodes and runs of s."""
    i = np.arange(d - s + 1)
    has_prev, has_next = i > 0, i + s < d
    k = np.arange(-1, d)  # insert between p[k] and p[k + 1]
    kk, k1 = np.clip(k, 0, d - 1)[None, :], np.clip(k + 1, 0, d - 1)[None, :]
    valid = ((k[None, :] <= i[:, None] - 2) | (k[None, :] >= i[:, None] + s)) & ~(
        (k[None, :] == -1) & (i[:, None] == 0)) & ~((k[None, :] == d - 1) & (i[:, None] + s == d))
    return (i, i + s - 1, np.maximum(i - 1, 0), np.minimum(i + s, d - 1), has_prev * 1.0,
            has_next * 1.0, (has_prev & has_next) * 1.0, kk, k1, (k >= 0)[None, :] * 1.0,
            (k <= d - 2)[None, :] * 1.0, np.clip(k, 0, max(d - 2, 0))[None, :],
            ((k >= 0) & (k <= d - 2))[None, :] * 1.0, ~valid)


def _relocate(p: np.ndarray, s: int, i: int, col: int, how: np.ndarray) -> np.ndarray:
    k = col - 1
    run = p[i:i + s][::-1] if how[i, col] else p[i:i + s]
    rest = np.concatenate([p[:i], p[i + s:]])
    at = k + 1 if k < i else k + 1 - s  # position in `rest` the run goes before
    return np.concatenate([rest[:at], run, rest[at:]])


def path_cost(links: np.ndarray, order: Sequence[int]) -> float:
    """Sum of links along an order of nodes."""
    return float(sum(links[a, b] for a, b in itertools.pairwise(order)))
