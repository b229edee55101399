"""One outer round's outcome shared inside a cluster: rank 0 talks to the averager (the relay),
checks what came back, and broadcasts it (gloo, CPU) to every rank, so that every rank applies
the same step or raises the same error."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nebula_cli.errors import NebulaError
from nebula_cli.relay.codecs.base import all_finite
from nebula_cli.relay.codecs.registry import KNOWN_CODECS
from nebula_cli.runtime.outer import SyncError
from nebula_cli.runtime.settle import keep


class AveragedRound(Protocol):
    """What an averager returns for one round (``relay.client.RoundResult`` has this shape).

    Optional attribute ``next_h`` (an int or None): the H to train before the next round
    (``inner_steps: auto``); ``next_merge`` (an int or None): overlap's agreed step for
    applying the next round's average. Optional attribute ``global_state`` (a tensor or None):
    set when this cluster was behind; it is then theta_global after round ``round_id`` and replaces
    ours (no outer step); ``global_momentum`` then the outer momentum that goes with it (or
    None).
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
    next_h: int | None = None  # inner_steps: auto: the H agreed for the next round
    codec: str = ""  # the codec of the round whose average this is ("": not said)
    next_merge: int | None = None  # overlap: the step the next round's average is applied at


class ClusterShare:
    """Rank 0's round outcome, broadcast to the cluster's ranks (``group``: a gloo group, or
    None for the default one)."""

    def __init__(self, rank: int, world_size: int, group: Any, numel: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.numel = numel

    def share(self, round_id: int, result: Any, error: BaseException | None) -> Shared:
        """Rank 0's round outcome (or failure), broadcast to every rank of the cluster."""
        header = torch.zeros(11, dtype=torch.float64)
        payload = momentum = None
        if self.rank == 0:
            if error is None:
                payload, state, error = self.check_result(round_id, result)
            if error is None:
                momentum = self.momentum_of(result) if state else None
                header = torch.tensor(
                    [1.0, len(result.present), result.bytes_sent, result.bytes_received,
                     result.seconds, int(getattr(result, "round_id", round_id)),
                     float(state), float(momentum is not None),
                     float(getattr(result, "next_h", None) or 0),
                     float(_codec_index(getattr(result, "codec", ""))),
                     float(getattr(result, "next_merge", None) or 0)], dtype=torch.float64)
        self.broadcast(header)
        if header[0].item() != 1.0:
            if self.rank == 0:
                if isinstance(error, NebulaError):
                    raise error
                raise SyncError(f"outer round {round_id} failed: {error}") from error
            raise SyncError(f"outer round {round_id} failed on this cluster's rank 0 (see its log)")
        if payload is None:
            payload = torch.empty(self.numel, dtype=torch.float32)
        self.broadcast(payload)
        has_state = header[6].item() == 1.0
        if header[7].item() == 1.0:
            if momentum is None:
                momentum = torch.empty(self.numel, dtype=torch.float32)
            self.broadcast(momentum)
        return Shared(
            round_id=int(header[5].item()) if has_state else round_id,
            avg=None if has_state else payload, state=payload if has_state else None,
            present=int(header[1].item()), bytes_sent=int(header[2].item()),
            bytes_received=int(header[3].item()), seconds=header[4].item(),
            clusters=list(result.present) if self.rank == 0 else None, momentum=momentum,
            next_h=int(header[8].item()) or None, codec=_codec_name(int(header[9].item())),
            next_merge=int(header[10].item()) or None)

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

    def broadcast(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.broadcast(keep(tensor), src=0, group=self.group)


def _codec_index(name: object) -> int:
    """A codec's name as a number a broadcast carries (0: none said)."""
    return KNOWN_CODECS.index(name) + 1 if name in KNOWN_CODECS else 0


def _codec_name(index: int) -> str:
    return KNOWN_CODECS[index - 1] if 0 < index <= len(KNOWN_CODECS) else ""


def round_stats(shared: Shared, t0: float, delta: torch.Tensor) -> dict[str, Any]:
    """What OuterSync returns (and logs) after a round that started at ``t0``
    (``time.perf_counter``); ``delta``: this cluster's contribution."""
    stats: dict[str, Any] = {
        "outer_round": shared.round_id,
        "round_s": time.perf_counter() - t0,
        "relay_s": shared.seconds,
        "wan_bytes_sent": shared.bytes_sent,
        "wan_bytes_received": shared.bytes_received,
        "clusters_present": shared.present,
        "delta_norm": float(delta.norm()),
        "avg_delta_norm": None if shared.avg is None else float(shared.avg.norm()),
        "applied": (shared.avg is not None and shared.present > 0) or shared.state is not None,
        "caught_up": shared.state is not None,
    }
    if shared.clusters is not None:
        stats["clusters"] = shared.clusters
    if shared.next_h is not None:
        stats["next_inner_steps"] = shared.next_h
    if shared.codec:
        stats["codec"] = shared.codec
    return stats
