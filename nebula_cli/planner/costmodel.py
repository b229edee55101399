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
  travelling salesman; exact dynamic programme up to 16 stages, 2-opt above).
- score = data cost + 2 * pipeline cost (forward activations and backward gradients), seconds.

The pipeline link is the paper's published code (one direction, no factor 2 inside): with a
factor 2 inside *and* the 2 of the score, the paper's own end points (14.75 s, 31.42 s) are
below what any placement can cost; without it, they are exactly the scores of its striped
placements. See tests/test_planner.py and bench/placement.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nebula_cli.errors import UsageError
from nebula_cli.planner.graphs import (
    bottleneck_from_bound,
    bottleneck_matching,
    open_tour,
    stacked_lower_bounds,
)

DeviceId = str | int
Groups = Sequence[Sequence[int]]


class PlanError(UsageError):
    """Planner input that cannot be used: says which figure, where, and what was expected."""


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
        self._links: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[float, list[int]]] = {}

    # -- parts -----------------------------------------------------------------------------
    def group_data_costs(self, groups: Groups) -> np.ndarray:
        """Each group's data-parallel cost (its slowest member's sum), in group order."""
        g = np.asarray(groups)
        return self.data_pair[g[:, :, None], g[:, None, :]].sum(axis=2).max(axis=1)

    def _link(self, a: Sequence[int], b: Sequence[int]) -> tuple[float, list[int], bool]:
        """(value, match, flipped) from the cache keyed by the two groups' sorted members; the
        match is for the key's order (flipped: b's group comes first in the key)."""
        ka, kb = tuple(sorted(a)), tuple(sorted(b))
        flip = ka > kb
        key = (kb, ka) if flip else (ka, kb)
        hit = self._links.get(key)
        if hit is None:
            if len(self._links) > 400_000:
                self._links.clear()
            hit = bottleneck_matching(self.pipe_pair[np.ix_(key[0], key[1])])
            self._links[key] = hit
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

    def link_matrix(self, groups: Groups) -> np.ndarray:
        """Stages x stages matrix of group-pair links (0 on the diagonal). Links not cached yet
        are bounded all at once (one vectorised step), then matched one by one."""
        g = np.sort(np.asarray(groups), axis=1)
        d = g.shape[0]
        keys = [tuple(row) for row in g.tolist()]
        e = np.zeros((d, d))
        todo_i, todo_j, todo_keys = [], [], []
        for i in range(d):
            for j in range(i + 1, d):
                if keys[i] > keys[j]:
                    i2, j2 = j, i
                else:
                    i2, j2 = i, j
                key = (keys[i2], keys[j2])
                hit = self._links.get(key)
                if hit is None:
                    todo_i.append(i2)
                    todo_j.append(j2)
                    todo_keys.append(key)
                else:
                    e[i, j] = e[j, i] = hit[0]
        if todo_keys:
            if len(self._links) > 400_000:
                self._links.clear()
            blocks = self.pipe_pair[g[todo_i][:, :, None], g[todo_j][:, None, :]]
            lower, masks = stacked_lower_bounds(blocks)
            for k, key in enumerate(todo_keys):
                hit = bottleneck_from_bound(blocks[k], float(lower[k]), masks[k])
                self._links[key] = hit
                i, j = todo_i[k], todo_j[k]
                e[i, j] = e[j, i] = hit[0]
        return e

    # -- the score -------------------------------------------------------------------------
    def evaluate(self, groups: Groups) -> Evaluation:
        """Score one partition and keep what explains it (no check that it is a partition;
        see `check_partition`)."""
        group_data = (self.group_data_costs(groups) if self.task.dp > 1
                      else np.zeros(len(groups)))
        links = self.link_matrix(groups)
        pipeline, order = open_tour(links)
        data = float(group_data.max())
        return Evaluation(Cost(data + 2 * pipeline, data, pipeline), order, group_data, links)

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
