"""The communication cost of a placement, after Yuan et al., NeurIPS 2022 (arXiv 2206.01288, §3).

N = stages x dp devices are split into `stages` groups of `dp` devices; group j holds one
pipeline stage, its members are that stage's data-parallel replicas. With delay d (ms) and
bandwidth b (Gbit/s) symmetrised by averaging both directions, sizes in GB:

- data-parallel cost of a group: the slowest member's sum over the other members of
  ``2 * (d/1000 + gradient_gb * 8 / (dp * b))`` (a sharded parameter server); the data cost is
  the maximum over the groups.
- link between two groups: the bottleneck perfect matching of their members minimising the
  largest ``d/1000 + activation_gb * 8 / b`` (which replica sends to which).
- pipeline cost: the cheapest open path through all groups over those links (an open-loop
  travelling salesman): exact (dynamic programme) up to EXACT_TOUR_MAX = 12 stages. Above, the
  order is a deterministic heuristic tour (nearest neighbour, 2-opt, Or-opt) on the links' lower
  bounds, and the pipeline cost is the exact links along that order (stages - 1 matchings, not
  stages^2 / 2); the score stays a function of the partition alone.
- score = data cost + 2 * pipeline cost (forward activations and backward gradients), seconds.

The pipeline link is the paper's published code (one direction, no factor 2 inside): with a
factor 2 inside *and* the 2 of the score, the paper's own end points (14.75 s, 31.42 s) are
below what any placement can cost; without it, they are exactly the scores of its striped
placements. See tests/planner/test_search.py and bench/placement.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from nebula_cli.errors import UsageError
from nebula_cli.planner.graphs import (
    EXACT_TOUR_MAX,
    bottleneck_from_bound,
    bottleneck_matching,
    open_tour,
    stacked_lower_bounds,
)

DeviceId = str | int
Hint = tuple[bytes, int, int]
"""(cache key of a neighbouring group pair, device it holds, device that replaces it)."""
BOUND_BLOCK = 1 << 22
"""Elements of pair blocks bounded at a time (memory cap)."""
LINK_CACHE_BYTES = 200_000_000
"""Memory the cache of group-pair links may take (about; it is emptied when full)."""
Groups = Sequence[Sequence[int]]


class PlanError(UsageError):
    """Planner input that cannot be used: says which figure, where, and what was expected."""


PAIR_MATRICES = 10
"""N x N float64 matrices the planner holds at its peak (figures, pair costs, temporaries)."""


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (MemAvailable), None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(need: int, what: str) -> None:
    """PlanError when `need` bytes exceed the memory available now."""
    have = available_memory()
    if have is not None and need > have:
        raise PlanError(f"{what} needs about {need / 2**30:.1f} GiB of memory, "
                        f"{have / 2**30:.1f} GiB is available: plan on a machine with more "
                        "memory, or split the network (e.g. plan each region, then the regions)")


@dataclass(frozen=True)
class Network:
    """Devices and the measured figures between every pair (symmetrised; the diagonal is 0)."""

    devices: tuple[DeviceId, ...]
    delay_ms: np.ndarray
    bandwidth_gbps: np.ndarray

    @classmethod
    def from_matrices(cls, devices: Sequence[DeviceId], delay_ms: object,
                      bandwidth_gbps: object) -> Network:
        """Check shapes and values, average the two directions of every pair."""
        ids = tuple(devices)
        n = len(ids)
        if n == 0:
            raise PlanError("no devices")
        check_memory(PAIR_MATRICES * 8 * n * n, f"a network of {n} devices")
        if len(set(ids)) != n:
            dup = next(d for d in ids if ids.count(d) > 1)
            raise PlanError(f"device id {dup!r} appears more than once")
        delay = _square(delay_ms, n, "delay_ms")
        bw = _square(bandwidth_gbps, n, "bandwidth_gbps")
        off = ~np.eye(n, dtype=bool)
        if (delay[off] < 0).any():
            i, j = np.argwhere((delay < 0) & off)[0]
            raise PlanError(f"delay_ms[{i}][{j}] is {delay[i, j]}: expected >= 0")
        if (bw[off] <= 0).any():
            i, j = np.argwhere((bw <= 0) & off)[0]
            raise PlanError(f"bandwidth_gbps[{i}][{j}] is {bw[i, j]}: expected > 0")
        delay = (delay + delay.T) / 2
        bw = (bw + bw.T) / 2
        np.fill_diagonal(delay, 0.0)
        np.fill_diagonal(bw, np.inf)
        delay.flags.writeable = False
        bw.flags.writeable = False
        return cls(ids, delay, bw)

    @property
    def size(self) -> int:
        return len(self.devices)


def _square(value: object, n: int, name: str) -> np.ndarray:
    try:
        m = np.array(value, dtype=float)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"{name}: expected an {n} x {n} matrix of numbers ({exc})") from exc
    if m.shape != (n, n):
        raise PlanError(f"{name}: expected an {n} x {n} matrix (one row per device), "
                        f"found shape {'x'.join(map(str, m.shape)) or 'scalar'}")
    off = ~np.eye(n, dtype=bool)
    if not np.isfinite(m[off]).all():
        i, j = np.argwhere(~np.isfinite(m) & off)[0]
        raise PlanError(f"{name}[{i}][{j}] is {m[i, j]}: expected a finite number")
    return m


@dataclass(frozen=True)
class Task:
    """The job's shape: `stages` x `dp` devices; GB of activations per macro-batch between
    consecutive stages and GB of one stage's gradients."""

    stages: int
    dp: int
    activation_gb: float
    gradient_gb: float

    def __post_init__(self) -> None:
        if self.stages < 1 or self.dp < 1:
            raise PlanError(f"stages and dp must be >= 1, found {self.stages} and {self.dp}")
        for name in ("activation_gb", "gradient_gb"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise PlanError(f"{name} must be a finite number >= 0, found {value}")

    @property
    def devices(self) -> int:
        return self.stages * self.dp


@dataclass(frozen=True)
class Cost:
    """A placement's score and its two parts, in seconds: score = data + 2 * pipeline."""

    score: float
    data: float
    pipeline: float


@dataclass(frozen=True)
class Evaluation:
    """A scored partition: its cost, the stage order of its groups (pipeline order), each
    group's data cost and the group-pair link matrix."""

    cost: Cost
    order: list[int]
    group_data: np.ndarray
    links: np.ndarray


class CostModel:
    """Scores partitions of one network's devices for one task; caches group-pair links.

    A partition is `stages` groups of `dp` device indices (into ``network.devices``), any order.
    """

    def __init__(self, network: Network, task: Task) -> None:
        if network.size != task.devices:
            raise PlanError(f"{network.size} devices cannot hold {task.stages} stages x "
                            f"{task.dp} replicas (= {task.devices}); stages x dp must equal "
                            "the number of devices")
        self.network, self.task = network, task
        delay_s = network.delay_ms / 1e3
        bw = network.bandwidth_gbps
        self.data_pair = 2 * (delay_s + task.gradient_gb * 8 / (task.dp * bw))
        self.pipe_pair = delay_s + task.activation_gb * 8 / bw
        np.fill_diagonal(self.data_pair, 0.0)
        np.fill_diagonal(self.pipe_pair, 0.0)
        self._links: dict[bytes, tuple[float, list[int]]] = {}
        self._cache_size = max(1000, LINK_CACHE_BYTES // (16 * task.dp + 200))

    # -- parts -----------------------------------------------------------------------------
    def group_data_costs(self, groups: Groups) -> np.ndarray:
        """Each group's data-parallel cost (its slowest member's sum), in group order."""
        g = np.asarray(groups)
        return self.data_pair[g[:, :, None], g[:, None, :]].sum(axis=2).max(axis=1)

    def _key(self, a: Sequence[int], b: Sequence[int]) -> tuple[bytes, bool, np.ndarray,
                                                             np.ndarray]:
        """The cache key of a group pair (the two sorted member lists, the group with the
        smaller first member first), whether b's group comes first, and both sorted groups."""
        sa, sb = np.sort(np.asarray(a, dtype=np.int64)), np.sort(np.asarray(b, dtype=np.int64))
        flip = bool(sa[0] > sb[0])
        key = (sb.tobytes() + sa.tobytes()) if flip else (sa.tobytes() + sb.tobytes())
        return key, flip, sa, sb

    def _store(self, key: bytes, hit: tuple[float, list[int]]) -> None:
        if len(self._links) >= self._cache_size:
            self._links.clear()
        self._links[key] = hit

    def _link(self, a: Sequence[int], b: Sequence[int]) -> tuple[float, list[int], bool]:
        """(value, match, flipped) from the cache keyed by the two groups' sorted members; the
        match is for the key's order (flipped: b's group comes first in the key)."""
        key, flip, sa, sb = self._key(a, b)
        hit = self._links.get(key)
        if hit is None:
            rows, cols = (sb, sa) if flip else (sa, sb)
            hit = bottleneck_matching(self.pipe_pair[np.ix_(rows, cols)])
            self._store(key, hit)
        return hit[0], hit[1], flip

    def link_value(self, a: Sequence[int], b: Sequence[int]) -> float:
        """The bottleneck matching value of groups a and b (cached)."""
        return self._link(a, b)[0]

    def link(self, a: Sequence[int], b: Sequence[int]) -> tuple[float, list[int]]:
        """Bottleneck matching of groups a and b: (largest pair cost, match), a[i] sending to
        b[match[i]], for a and b in the caller's order."""
        value, mate, flip = self._link(a, b)
        sa, sb = sorted(a), sorted(b)
        if flip:  # the key is (sb, sa): sb[j] -> sa[mate[j]]
            to_b = {sa[mate[j]]: sb[j] for j in range(len(sb))}
        else:
            to_b = {sa[i]: sb[mate[i]] for i in range(len(sa))}
        where_b = {d: i for i, d in enumerate(b)}
        return value, [where_b[to_b[d]] for d in a]

    def link_values(self, groups: np.ndarray, pairs_i: Sequence[int], pairs_j: Sequence[int],
                    hints: Sequence[Hint | None] | None = None) -> np.ndarray:
        """Links of the group pairs (groups[pairs_i[k]], groups[pairs_j[k]]); `groups` has
        sorted rows. Pairs not cached yet are bounded all at once (one vectorised step), then
        matched one by one, each starting from its hint's matching when it has one (see
        `Hint`)."""
        g = groups
        out = np.empty(len(pairs_i))
        todo_i, todo_j, todo_k, todo_keys = [], [], [], []
        for k, (i, j) in enumerate(zip(pairs_i, pairs_j, strict=True)):
            if g[i, 0] > g[j, 0]:
                i, j = j, i
            key = g[i].tobytes() + g[j].tobytes()
            hit = self._links.get(key)
            if hit is None:
                todo_i.append(i)
                todo_j.append(j)
                todo_k.append(k)
                todo_keys.append(key)
            else:
                out[k] = hit[0]
        if todo_keys:
            blocks = self.pipe_pair[g[todo_i][:, :, None], g[todo_j][:, None, :]]
            lower, masks = stacked_lower_bounds(blocks)
            for t, key in enumerate(todo_keys):
                hint = hints[todo_k[t]] if hints is not None else None
                start = None if hint is None else self._start(hint, g[todo_i[t]], g[todo_j[t]])
                hit = bottleneck_from_bound(blocks[t], float(lower[t]), masks[t], start)
                self._store(key, hit)
                out[todo_k[t]] = hit[0]
        return out

    def _start(self, hint: Hint, rows: np.ndarray, cols: np.ndarray) -> list[int] | None:
        """The hint's cached matching, device `old` replaced by `new`, as a start for the
        matching of the group pair (rows, cols); None when it is not cached."""
        key, old, new = hint
        hit = self._links.get(key)
        if hit is None:
            return None
        half = len(key) // 2
        src = np.frombuffer(key[:half], dtype=np.int64)
        dst = np.frombuffer(key[half:], dtype=np.int64)[np.asarray(hit[1])]
        src = np.where(src == old, new, src)
        dst = np.where(dst == old, new, dst)
        if src[0] not in rows:  # the new key has the pair the other way round
            src, dst = dst, src
        start = np.full(rows.size, -1)
        start[np.searchsorted(rows, src)] = np.searchsorted(cols, dst)
        return start.tolist()

    def link_matrix(self, groups: Groups) -> np.ndarray:
        """Stages x stages matrix of group-pair links (0 on the diagonal)."""
        g = np.sort(np.asarray(groups, dtype=np.int64), axis=1)
        d = g.shape[0]
        iu, ju = np.triu_indices(d, 1)
        e = np.zeros((d, d))
        if iu.size:
            e[iu, ju] = self.link_values(g, iu.tolist(), ju.tolist())
            e[ju, iu] = e[iu, ju]
        return e

    # -- the score -------------------------------------------------------------------------
    def evaluate(self, groups: Groups) -> Evaluation:
        """Score one partition and keep what explains it (no check that it is a partition;
        see `check_partition`)."""
        group_data = (self.group_data_costs(groups) if self.task.dp > 1
                      else np.zeros(len(groups)))
        if len(groups) > EXACT_TOUR_MAX:
            g = np.sort(np.asarray(groups, dtype=np.int64), axis=1)
            iu, ju = np.triu_indices(g.shape[0], 1)
            links = np.zeros((g.shape[0], g.shape[0]))
            links[iu, ju] = self.link_bounds(g, iu, ju)
            links[ju, iu] = links[iu, ju]
            pipeline, order = self.pipeline_on_bounds(g, links)
        else:
            links = self.link_matrix(groups)
            pipeline, order = open_tour(links)
        data = float(group_data.max())
        return Evaluation(Cost(data + 2 * pipeline, data, pipeline), order, group_data, links)

    def link_bounds(self, groups: np.ndarray, pairs_i: np.ndarray,
                    pairs_j: np.ndarray) -> np.ndarray:
        """Lower bounds of the links of group pairs (max of the block's row and column minima),
        vectorised, in blocks of at most BOUND_BLOCK elements."""
        dp = groups.shape[1]
        out = np.empty(len(pairs_i))
        step = max(1, BOUND_BLOCK // (dp * dp))
        for lo in range(0, len(pairs_i), step):
            gi, gj = groups[pairs_i[lo:lo + step]], groups[pairs_j[lo:lo + step]]
            blocks = self.pipe_pair[gi[:, :, None], gj[:, None, :]]
            out[lo:lo + step] = np.maximum(blocks.min(axis=2).max(axis=1),
                                           blocks.min(axis=1).max(axis=1))
        return out

    def pipeline_on_bounds(self, groups: np.ndarray, bounds: np.ndarray,
                           hint_of: Callable[[int, int], Hint | None] | None = None
                           ) -> tuple[float, list[int]]:
        """Above EXACT_TOUR_MAX stages: the stage order is the heuristic tour on the links' lower
        bounds (no matching needed), and the pipeline cost is the exact links along it (stages -
        1 matchings instead of stages^2 / 2). `hint_of(i, j)`: a matching to start from."""
        _, order = open_tour(bounds)
        hints = None if hint_of is None else [hint_of(i, j) for i, j in
                                              zip(order[:-1], order[1:], strict=True)]
        exact = self.link_values(groups, order[:-1], order[1:], hints)
        return float(sum(exact.tolist())), order

    def cost(self, groups: Groups) -> Cost:
        """The score of one partition and its two parts."""
        return self.evaluate(groups).cost

    def check_partition(self, groups: Groups) -> None:
        """Raise PlanError unless groups is `stages` groups of `dp` distinct device indices."""
        n, t = self.network.size, self.task
        if len(groups) != t.stages or any(len(g) != t.dp for g in groups):
            raise PlanError(f"expected {t.stages} groups of {t.dp} devices")
        flat = sorted(int(x) for g in groups for x in g)
        if flat != list(range(n)):
            raise PlanError("every device must appear in exactly one group")
