"""The two combinatorial pieces of the cost model, usable on their own: the bottleneck perfect
matching of two groups (which replica sends to which) and the cheapest open path through all
groups (the pipeline order)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

EXACT_TOUR_MAX = 16
"""Stage counts up to this get an exact open tour (Held-Karp); above, a 2-opt tour."""


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
    lower = max(cost.min(axis=1).max(), cost.min(axis=0).max())
    rows = [int(x) for x in ((cost <= lower) * _bit_weights(n)).sum(axis=1)]
    return bottleneck_from_bound(cost, float(lower), rows)


def stacked_lower_bounds(blocks: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
    """For a stack of square matrices: each one's lower bound (max of row minima and column
    minima) and the bitmask rows of its entries up to that bound."""
    lower = np.maximum(blocks.min(axis=2).max(axis=1), blocks.min(axis=1).max(axis=1))
    allowed = blocks <= lower[:, None, None]
    n = blocks.shape[1]
    if n > 62:
        masks = [[int(x) for x in row] for row in (allowed * _bit_weights(n)).sum(axis=2)]
    else:
        masks = (allowed * _bit_weights(n)).sum(axis=2).tolist()
    return lower, masks


def bottleneck_from_bound(cost: np.ndarray, lower: float,
                          rows: list[int]) -> tuple[float, list[int]]:
    """bottleneck_matching given the lower bound and the bitmask rows of entries <= it."""
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
    for r in range(n):  # greedy start
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
    return 1 << np.arange(n, dtype=object) if n > 62 else 1 << np.arange(n, dtype=np.int64)


def open_tour(links: np.ndarray) -> tuple[float, list[int]]:
    """Cheapest open path visiting every node once: (cost, order). Exact (Held-Karp over
    subsets, size by size) up to 16 nodes; 2-opt from every start above."""
    d = links.shape[0]
    if d == 1:
        return 0.0, [0]
    if d > EXACT_TOUR_MAX:
        return _two_opt_tour(links)
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


def _two_opt_tour(links: np.ndarray) -> tuple[float, list[int]]:
    d = links.shape[0]
    best_order: list[int] = []
    best = math.inf
    for start in range(d):
        order, left = [start], set(range(d)) - {start}
        while left:
            nxt = min(left, key=lambda k, last=order[-1]: links[last, k])
            order.append(nxt)
            left.remove(nxt)
        improved = True
        while improved:
            improved = False
            for i, j in itertools.combinations(range(d), 2):
                new = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                if path_cost(links, new) < path_cost(links, order) - 1e-12:
                    order, improved = new, True
        cost = path_cost(links, order)
        if cost < best:
            best, best_order = cost, order
    return best, best_order


def path_cost(links: np.ndarray, order: Sequence[int]) -> float:
    """Sum of links along an order of nodes."""
    return float(sum(links[a, b] for a, b in itertools.pairwise(order)))
