"""What a round leaves behind, as named types: the :class:`RoundOutcome` a worker gets, the
:class:`Average` a relay keeps (and serves to a peer that missed it), and the
:class:`GlobalState` a worker published (served to a cluster that catches up)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch

from nebula_cli.relay.protocol.next_round import NextRound


class RoundMode(StrEnum):
    """How a relay ended a round."""

    ALONE = "alone"
    """Averaged alone: nobody else was present or reachable."""
    DIRECT = "direct"
    """Exchanged with the other present relays, each averaging every chunk itself."""
    SHARD = "shard"
    """Exchanged with the other present relays, each averaging the chunks it owns."""
    FETCHED = "fetched"
    """Left out (late, rejected, or its exchange failed): fetched the average from a peer."""
    CACHED = "cached"
    """Behind: the round's average was already here."""
    CATCH_UP = "catch-up"
    """Behind: took a peer's published global state."""
    RESYNC = "resync"
    """Its global state diverged: took a present peer's."""
    EMPTY = "empty"
    """Left out and nobody was present: zeros."""
    FAILED = "failed"
    """No average and no state to take: zeros."""


@dataclass
class RoundOutcome:
    """What the relay tells its worker at the end of a round."""

    tensor: torch.Tensor
    present: list[str]
    round_id: int
    rejected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    global_state: torch.Tensor | None = None
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    mode: RoundMode = field(kw_only=True)
    lineage: str | None = None
    """Set when the outcome hands over a peer's global state: that state's lineage."""
    weights: dict[str, float] = field(default_factory=dict)
    """The present clusters' weights in the average (samples; empty: equal)."""
    codec: str = ""
    """The codec of the round whose average this is (the worker's outer settings follow it)."""
    next: NextRound = NextRound()
    """What the round's decision says of the next round (with overlap, an outcome without a
    decision of its own carries the merge step of the newest decision this relay saw)."""


@dataclass(frozen=True)
class Average:
    """A completed round's average and who was in it."""

    round_id: int
    present: list[str]
    rejected: list[str]
    tensor: torch.Tensor
    codec: str = ""
    """The round's codec (``compression: auto``: the worker applies it with that codec's outer
    settings; "" for one codec)."""


STATE_PARTS = (1, 2)
"""A published state is theta_global (1 part) or theta_global then the outer momentum (2)."""


@dataclass(frozen=True)
class GlobalState:
    """theta_global after ``round_id`` as a worker published it (followed by the outer
    momentum when ``parts`` is 2), and the lineage it belongs to (see relay.lineage)."""

    round_id: int
    tensor: torch.Tensor
    lineage: str = ""
    parts: int = 1
