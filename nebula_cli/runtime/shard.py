"""This rank's shard of the synced vector, and the cluster's collectives that move shards.

The outer state (theta_global, the outer momentum, overlap's anchor) is held per rank as a
contiguous slice of the flat fp32 vector: rank r of W owns ``[r * size, (r + 1) * size)``
clipped to the vector, ``size = ceil(numel / W)`` (the shape of torchft's and INTELLECT-1's
per-shard outer step, STYLE.md). No rank keeps a full copy of the outer state; a full vector
exists only in flight: on rank 0 for the relay's hop (the gathered delta, the average it
scatters) and on every rank while the new parameters are written (ZeRO 0 ranks hold every
parameter anyway).

The shards move point to point (``isend``/``irecv``), each received in place in the vector it
joins: gloo's gather, scatter and all-gather stage every rank's part in one more flat buffer
(an all-gather of 20 M values took two whole copies on each rank, this one). The last ranks'
shards are shorter than ``size``, or empty when W > numel; an empty one is not sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nebula_cli.runtime.outer import SyncError
from nebula_cli.runtime.settle import keep


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world``'s part ``[lo, hi)`` of a vector of ``numel`` elements."""

    numel: int
    rank: int = 0
    world: int = 1

    @property
    def size(self) -> int:
        """Every rank's padded length (the collectives' unit)."""
        return -(-self.numel // self.world) if self.numel else 0

    def bounds(self, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) of ``rank`` (this one by default)."""
        r = self.rank if rank is None else rank
        lo = min(r * self.size, self.numel)
        return lo, min(lo + self.size, self.numel)

    @property
    def lo(self) -> int:
        return self.bounds()[0]

    @property
    def hi(self) -> int:
        return self.bounds()[1]

    @property
    def length(self) -> int:
        return self.hi - self.lo

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full vector (a view)."""
        return full.narrow(0, self.lo, self.length)


class ShardMoves:
    """The cluster's shard collectives over ``group`` (gloo; None: the default group). With one
    rank each hands back its input (no copy), or copies it into the ``out`` it is given."""

    def __init__(self, shard: Shard, group: Any) -> None:
        self.shard = shard
        self.group = group

    def gather(self, part: torch.Tensor, dst: int = 0, out: torch.Tensor | None = None
               ) -> torch.Tensor | None:
        """Every rank's shard, joined on rank ``dst`` (the full vector there; None elsewhere).
        Point to point, each shard received in place (gloo's gather would stage them all in
        one more flat buffer); into ``out`` on ``dst`` when given (memory the relay's hop
        sends without a copy), where ``dst``'s own shard may already lie in its place."""
        if self.shard.world == 1 and out is None:
            return part
        return self._join(part, 0, self.shard.numel, {dst}, out if self.shard.rank == dst
                          else None)

    def scatter(self, full: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's full vector cut into shards: this rank's part (a tensor of its own). Point to
        point: each shard sent from its place in the vector, no copy of it on rank 0."""
        if self.shard.world == 1:
            if full is None:
                raise SyncError("scatter of nothing on a cluster of one rank")
            return full
        if self.shard.rank != 0:
            out = torch.empty(self.shard.length, dtype=torch.float32)
            if out.numel():
                dist.recv(keep(out), self._global(0), group=self.group)
            return out
        if full is None:
            raise SyncError("scatter on rank 0 without the vector")
        full = full.detach().to("cpu", torch.float32).reshape(-1).contiguous()
        works = []
        for r in range(1, self.shard.world):
            lo, hi = self.shard.bounds(r)
            if hi > lo:
                works.append(dist.isend(keep(full.narrow(0, lo, hi - lo)), self._global(r),
                                        group=self.group))
        for work in works:
            work.wait()
        return self.shard.of(full).clone()

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's shard, joined on every rank (the full vector)."""
        return self.all_gather_range(part, 0, self.shard.numel)

    def all_gather_range(self, part: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the vector whose shards the ranks hold, joined on every rank
        (every rank calls it with the same range). Point to point, each piece received in place:
        gloo's all-gather stages its output once more (two whole copies at 20 M, one here)."""
        if self.shard.world == 1:
            return part.narrow(0, lo, hi - lo)
        out = self._join(part, lo, hi, set(range(self.shard.world)))
        if out is None:  # (every rank is one of `to`)
            raise SyncError(f"rank {self.shard.rank} joined nothing")
        return out

    def _join(self, part: torch.Tensor, lo: int, hi: int, to: set[int],
              out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Elements ``[lo, hi)`` joined on the ranks in ``to`` (None on the others), into
        ``out`` when given: each rank sends its piece of the range to every rank of ``to`` but
        itself, each piece received in place (a piece already in its place is not copied)."""
        part = part.detach().to("cpu", torch.float32).reshape(-1)
        me = self.shard.rank
        if me in to and out is None:
            out = torch.empty(hi - lo, dtype=torch.float32)
        elif out is not None and (me not in to or out.numel() != hi - lo):
            raise SyncError(f"rank {me}: a join of {hi - lo} values into {out.numel()}")
        works = []
        for r in range(self.shard.world):
            a, b = self.shard.bounds(r)
            a, b = max(a, lo), min(b, hi)
            if a >= b:
                continue
            if r == me:
                mine = part.narrow(0, a - self.shard.lo, b - a)
                if out is not None:
                    place = out.narrow(0, a - lo, b - a)
                    if place.data_ptr() != mine.data_ptr():
                        place.copy_(mine)
                    mine = place
                else:
                    mine = mine.contiguous()
                works += [dist.isend(keep(mine), self._global(other), group=self.group)
                          for other in sorted(to) if other != me]
            elif out is not None:
                works.append(dist.irecv(keep(out.narrow(0, a - lo, b - a)), self._global(r),
                                        group=self.group))
        for work in works:
            work.wait()
        return out

    def _global(self, rank: int) -> int:
        """The default group's rank of ``rank`` of this group (dst and src are global)."""
        if self.group is None:
            return rank
        return dist.get_global_rank(self.group, rank)

    def sum_squares(self, *parts: torch.Tensor | None) -> list[float]:
        """Each vector's squared norm summed over the ranks' shards (one small all-reduce); a
        None part counts 0."""
        sq = torch.tensor([0.0 if p is None else float(torch.linalg.vector_norm(p)) ** 2
                           for p in parts], dtype=torch.float64)  # (no copy of the shard)
        if self.shard.world > 1:
            dist.all_reduce(keep(sq), group=self.group)
        return [float(x) for x in sq]

