"""What a round leaves behind, as named types: the :class:`RoundOutcome` a worker gets, the
:class:`Average` a relay keeps (and serves to a peer that missed it), and the
:class:`GlobalState` a worker published (served to a cluster that catches up)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    mode: str = ""
    lineage: str | None = None
    """Set when the outcome hands over a peer's global state: that state's lineage."""
    weights: dict[str, float] = field(default_factory=dict)
    """The present clusters' weights in the average (samples; empty: equal)."""
    next_h: int | None = None
    next_h_why: str = ""
    """``inner_steps: auto``: the H the round's decision says every cluster trains next (and
    with ``compression: auto`` why the next codec was chosen)."""
    codec: str = ""
    """The codec of the round whose average this is (the worker's outer settings follow it)."""
    next_codec: str = ""
    """``compression: auto``: the codec the round's decision says the next round uses."""
    next_merge: int | None = None
    """Overlap: the step after its boundary at which every cluster applies the next round's
    average (the round's decision)."""


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
