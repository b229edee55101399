"""One outer round's outcome shared inside a cluster: rank 0 talks to the averager (the relay),
checks what came back, and broadcasts it (gloo, CPU) to every rank, so that every rank applies
the same step or raises the same error.

The broadcast is a :class:`RoundHeader` (what the round was, and the
:class:`~nebula_cli.relay.protocol.next_round.NextRound` the relays agreed, whole), encoded by
that class alone as a fixed-size byte tensor of JSON, then the round's tensors."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nebula_cli.errors import NebulaError
from nebula_cli.relay.codecs.base import all_finite
from nebula_cli.relay.net.schema import decode, encode
from nebula_cli.relay.protocol.next_round import NextRound
from nebula_cli.runtime.outer import SyncError
from nebula_cli.runtime.settle import keep
from nebula_cli.runtime.shard import Shard, ShardMoves

HEADER_BYTES = 4096
"""The room of a round's header on the broadcast: its JSON at most (a NextRound's longest
explanation and codec name, escaped, fit with room to spare)."""


class AveragedRound(Protocol):
    """What an averager returns for one round (``relay.client.RoundResult`` has this shape).

    Optional attribute ``next`` (a :class:`NextRound`): what the relays agreed of the next
    round (``inner_steps: auto``: its H; overlap: the step its average is applied at);
    ``codec`` (a str): the codec of the round. Optional attribute ``global_state`` (a tensor
    or None): set when this cluster was behind; it is then theta_global after round
    ``round_id`` and replaces ours (no outer step); ``global_momentum`` then the outer momentum
    that goes with it (or None).
    """

    tensor: torch.Tensor  # the average over the clusters present, flat fp32 CPU
    present: list[str]  # names of the clusters whose contribution is in the average
    round_id: int
    bytes_sent: int
    bytes_received: int
    seconds: float


class Averager(Protocol):
    """Averages one flat fp32 CPU tensor per round across the clusters (the relay client).

    ``info`` (samples, step_s, comm_s: runtime.cadence) is what the cluster tells the relay
    about its round. Optional method ``publish_state(round_id, tensor, momentum)``: when
    present, rank 0 hands it theta_global (and the outer momentum) after every applied round,
    for clusters that fall behind or diverge to take. Optional method ``final_state(wait)``: at
    the end, the (round, theta, momentum) every cluster should end with when it is not ours.
    """

    def allreduce(self, round_id: int, tensor: torch.Tensor,
                  info: dict[str, float] | None = None) -> AveragedRound: ...

    def close(self) -> None: ...


@dataclass
class Shared:
    """A round's outcome as every rank of the cluster sees it after the broadcast."""

    round_id: int  # the round applied (a caught-up cluster: the round of the global state)
    avg: torch.Tensor | None  # the average over the clusters present
    state: torch.Tensor | None  # set when this cluster was behind: a peer's theta_global
    present: int
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    clusters: list[str] | None = None  # names, known on rank 0 only
    momentum: torch.Tensor | None = None  # with ``state``: the peer's outer momentum
    codec: str = ""  # the codec of the round whose average this is ("": not said)
    next: NextRound = NextRound()  # what the relays agreed of the next round
    publish: bool = False  # rank 0's averager takes the global state after the round


@dataclass(frozen=True)
class RoundHeader:
    """What rank 0 tells every rank of the cluster about a round before its tensors: whether
    it has one (``ok``), what it was, and what the next round is."""

    ok: bool = False
    present: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    round_id: int = 0
    has_state: bool = False
    has_momentum: bool = False
    codec: str = ""
    next: NextRound = NextRound()
    publish: bool = False

    def to_tensor(self) -> torch.Tensor:
        """The header as HEADER_BYTES of JSON (zero-padded), for the broadcast."""
        data = json.dumps({"ok": self.ok, "present": self.present,
                           "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                           "seconds": self.seconds, "round_id": self.round_id,
                           "has_state": self.has_state, "has_momentum": self.has_momentum,
                           "codec": self.codec, "publish": self.publish,
                           **encode(self.next)},
                          separators=(",", ":")).encode()
        if len(data) > HEADER_BYTES:
            raise SyncError(f"a round header of {len(data)} bytes (at most {HEADER_BYTES})")
        out = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> RoundHeader:
        """What :meth:`to_tensor` made; a tensor of zeros (nothing broadcast) is not ok."""
        data = bytes(t.numpy()).rstrip(b"\0")
        if not data:
            return cls()
        m = json.loads(data)
        return cls(bool(m["ok"]), int(m["present"]), int(m["bytes_sent"]),
                   int(m["bytes_received"]), float(m["seconds"]), int(m["round_id"]),
                   bool(m["has_state"]), bool(m["has_momentum"]), str(m["codec"]),
                   decode(NextRound, m, what="round header"), bool(m["publish"]))


class ClusterShare:
    """Rank 0's round outcome, broadcast to the cluster's ranks (``group``: a gloo group, or
    None for the default one); and small flags all the ranks agree on (``reduce_max``: the end's
    wait, runtime.final). With ``sharded`` (DiLoCo rounds) the round's tensors are scattered:
    each rank gets its own shard of them (runtime/shard.py), not the whole vector."""

    def __init__(self, rank: int, world_size: int, group: Any, numel: int,
                 sharded: bool = False) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.numel = numel
        self.sharded = sharded
        self.moves = ShardMoves(Shard(numel, rank, world_size) if sharded else Shard(numel),
                                group)

    def share(self, round_id: int, result: Any, error: BaseException | None,
              publish: bool = False) -> Shared:
        """Rank 0's round outcome (or failure), broadcast to every rank of the cluster
        (``publish``, said by rank 0: its averager takes the global state after the round)."""
        head = RoundHeader()
        payload = momentum = None
        if self.rank == 0:
            if error is None:
                payload, state, error = self.check_result(round_id, result)
            if error is None:
                momentum = self.momentum_of(result) if state else None
                head = RoundHeader(
                    True, len(result.present), int(result.bytes_sent),
                    int(result.bytes_received), float(result.seconds),
                    int(getattr(result, "round_id", round_id)), state, momentum is not None,
                    str(getattr(result, "codec", "") or ""),
                    getattr(result, "next", None) or NextRound(), publish)
        buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            try:
                buf = head.to_tensor()
            except SyncError as exc:  # the other ranks still hear that the round failed
                error = exc
        self.broadcast(buf)
        head = RoundHeader.from_tensor(buf)  # every rank sees the same (decoded) header
        if not head.ok:
            if self.rank == 0:
                if isinstance(error, NebulaError):
                    raise error
                raise SyncError(f"outer round {round_id} failed: {error}") from error
            raise SyncError(f"outer round {round_id} failed on this cluster's rank 0 (see its log)")
        payload = self.distribute(payload)
        if head.has_momentum:
            momentum = self.distribute(momentum)
        return Shared(
            round_id=head.round_id if head.has_state else round_id,
            avg=None if head.has_state else payload,
            state=payload if head.has_state else None, present=head.present,
            bytes_sent=head.bytes_sent, bytes_received=head.bytes_received,
            seconds=head.seconds, clusters=list(result.present) if self.rank == 0 else None,
            momentum=momentum, codec=head.codec, next=head.next, publish=head.publish)

    def check_result(self, round_id: int, result: Any
                      ) -> tuple[torch.Tensor | None, bool, BaseException | None]:
        """(the tensor to broadcast, whether it is a global state, an error)."""
        state = getattr(result, "global_state", None)
        tensor = state if state is not None else getattr(result, "tensor", None)
        what = "global state" if state is not None else "average"
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != self.numel:
            got = tensor.numel() if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            return None, False, SyncError(f"outer round {round_id}: the averager returned a "
                                          f"{what} of {got} values, expected {self.numel}")
        flat = tensor.detach().to("cpu", torch.float32).reshape(-1).contiguous()
        if not all_finite(flat):
            return None, False, SyncError(f"outer round {round_id}: the {what} is not finite")
        return flat, state is not None, None

    def momentum_of(self, result: Any) -> torch.Tensor | None:
        """The outer momentum a state came with, when it has this cluster's size and is
        finite (else None: the cluster keeps its own)."""
        m = getattr(result, "global_momentum", None)
        if not isinstance(m, torch.Tensor) or m.numel() != self.numel:
            return None
        flat = m.detach().to("cpu", torch.float32).reshape(-1).contiguous()
        return flat if all_finite(flat) else None

    def distribute(self, full: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's full vector on every rank: whole (a broadcast), or this rank's shard of it
        (a scatter) when sharded."""
        if self.sharded:
            return self.moves.scatter(full)
        if full is None:
            full = torch.empty(self.numel, dtype=torch.float32)
        self.broadcast(full)
        return full

    def broadcast(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.broadcast(keep(tensor), src=0, group=self.group)

    def norms(self, delta: torch.Tensor, avg: torch.Tensor | None) -> tuple[float, float | None]:
        """The norms of a round's delta and average over the whole vector (the ranks' shards
        summed when sharded: one small all-reduce on every rank)."""
        if self.sharded:
            d, a = self.moves.sum_squares(delta, avg)
            return d ** 0.5, None if avg is None else a ** 0.5
        return float(delta.norm()), None if avg is None else float(avg.norm())

    def reduce_max(self, tensor: torch.Tensor) -> None:
        """Every rank's ``tensor`` becomes its element-wise maximum over the cluster's ranks."""
        if self.world_size > 1:
            dist.all_reduce(keep(tensor), op=dist.ReduceOp.MAX, group=self.group)


def round_stats(shared: Shared, t0: float, norms: tuple[float, float | None]
                ) -> dict[str, Any]:
    """What OuterSync returns (and logs) after a round that started at ``t0``
    (``time.perf_counter``); ``norms``: of this cluster's contribution and of the average
    (``ClusterShare.norms``)."""
    stats: dict[str, Any] = {
        "outer_round": shared.round_id,
        "round_s": time.perf_counter() - t0,
        "relay_s": shared.seconds,
        "wan_bytes_sent": shared.bytes_sent,
        "wan_bytes_received": shared.bytes_received,
        "clusters_present": shared.present,
        "delta_norm": norms[0],
        "avg_delta_norm": norms[1],
        "applied": (shared.avg is not None and shared.present > 0) or shared.state is not None,
        "caught_up": shared.state is not None,
    }
    if shared.clusters is not None:
        stats["clusters"] = shared.clusters
    if shared.next.h is not None:
        stats["next_inner_steps"] = shared.next.h
    if shared.codec:
        stats["codec"] = shared.codec
    return stats
