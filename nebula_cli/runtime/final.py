"""The end of a run across clusters: every cluster leaves with the same parameters.

Clusters do not always end on the same outer round: one that caught up from a peer's state
skipped round ids, and one whose peers had finished made its last round alone. After its last
round (``OuterSync.finish``) a cluster's rank 0 asks its relay for the final state
(``RelayClient.final_state``): the relay waits until every other cluster's workers have
finished (also a cluster not connected just then, which may come back), then hands over
the state of the cluster that finished last when it is not this cluster's own (see
``nebula_cli.relay.protocol.recovery``). Every rank of the cluster takes it (a broadcast), so
that all workers of all clusters hold identical parameters at the end.

The wait can be long (another cluster much slower, or cut off). Rank 0 asks in a thread of its
own, and every ``HEARTBEAT_S`` the cluster's ranks agree (one small all-reduce) on whether the
answer came and whether any of them was asked to stop: no rank sits in one collective for the
whole wait, and a stop ends it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from nebula_cli.runtime.cluster_share import ClusterShare, Shared
from nebula_cli.runtime.threads import start_or_run

log = logging.getLogger("nebula.sync")

HEARTBEAT_S = 2.0
"""While rank 0 waits for the final state, how often every rank of its cluster hears that it
still waits, and tells it of a stop request. The other ranks sit in short collectives, never in
one as long as the wait: that can outlast a process group's timeout (gloo's and DeepSpeed's
default: 30 minutes) when another cluster finishes much later, and a stop (``nebula stop``)
would otherwise find every rank blocked, and lose the final checkpoint to the kill after the
grace."""


@dataclass
class _FinalState:
    """A final state in the shape of a round result (for the cluster broadcast)."""

    round_id: int
    global_state: torch.Tensor
    global_momentum: torch.Tensor | None
    tensor: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    present: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


class Word(IntEnum):
    """Rank 0's word to its cluster on each beat of the wait (the largest value wins the
    all-reduce: the other ranks say NONE)."""

    NONE = 0  # done: this cluster keeps its own parameters
    TAKEN = 1  # done: a state to take follows (a broadcast)
    WAITING = 2  # the other clusters have not all finished


class _Asking:
    """Rank 0's question to its relay, in a thread of its own, so that rank 0 can speak to its
    cluster on every beat while the relay waits for the other clusters to finish."""

    def __init__(self, ask: Callable[[float | None], tuple[Any, Any, Any]]) -> None:
        self.taken: _FinalState | None = None
        self.abandoned = False
        """Set when a stop ended the wait: the answer no longer matters (nor its failure)."""
        self._done = threading.Event()
        # (where no thread can be had: asked here, the other ranks wait in the first beat)
        start_or_run(self._run, (ask,), "nebula-final-state")

    def _run(self, ask: Callable[[float | None], tuple[Any, Any, Any]]) -> None:
        try:
            round_id, theta, momentum = ask(None)
            if theta is not None:
                self.taken = _FinalState(int(round_id), theta, momentum)
        except Exception as exc:  # the run is over: keep this cluster's parameters, say so
            if not self.abandoned:
                log.warning("could not agree on the final state with the other clusters: %s "
                            "(this cluster keeps its own)", exc)
        finally:
            self._done.set()

    def word(self, beat: float) -> Word:
        """After at most ``beat`` seconds: still waiting, or what the relay answered."""
        if not self._done.wait(beat):
            return Word.WAITING
        return Word.NONE if self.taken is None else Word.TAKEN


def final_agreement(averager: Any, cluster: ClusterShare, apply: Callable[[Shared], bool],
                    write: Callable[[], None], stats: dict[str, Any] | None,
                    stop: Callable[[], bool] | None = None, beat: float = HEARTBEAT_S
                    ) -> dict[str, Any] | None:
    """On every rank, after the last round: take the final state every cluster ends with when
    it is not ours (``averager``: rank 0's, None elsewhere). ``apply`` sets theta_global (and
    the outer momentum) from it, ``write`` puts theta_global into the parameters. Every
    ``beat`` seconds of the wait the ranks agree on whether it is over and whether ``stop``
    (None: never) is true on any of them (then the cluster keeps its own parameters). Returns
    ``stats`` with ``final_state_round`` when a state was taken."""
    ask = getattr(averager, "final_state", None)
    asking = _Asking(ask) if ask is not None else None
    while True:
        word = asking.word(beat) if asking is not None else Word.NONE
        stopping = stop is not None and bool(stop())
        said = torch.tensor([float(word), float(stopping)], dtype=torch.float64)
        cluster.reduce_max(said)
        word = Word(int(said[0].item()))
        if word is not Word.WAITING:
            break
        if said[1].item() > 0:
            if asking is not None:
                asking.abandoned = True
                log.warning("stopped while waiting for the other clusters to finish: this "
                            "cluster keeps its own parameters")
            return stats
    if word is Word.NONE:
        return stats
    shared = cluster.share(-1, asking.taken if asking is not None else None, None)
    apply(shared)
    write()
    log.info("took the final state of the cluster that finished last (after its round %d)",
             shared.round_id)
    return {**(stats or {}), "final_state_round": shared.round_id}
