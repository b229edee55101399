"""The end of a run across clusters: every cluster leaves with the same parameters.

Clusters do not always end on the same outer round: one that caught up from a peer's state
skipped round ids, and one whose peers had finished made its last round alone. After its last
round (``OuterSync.finish``) a cluster's rank 0 asks its relay for the final state
(``RelayClient.final_state``): the relay waits until every other cluster's workers have
finished (also a cluster not connected just then, which may come back), then hands over
the state of the cluster that finished last when it is not this cluster's own (see
``nebula_cli.relay.protocol.recovery``). Every rank of the cluster takes it (a broadcast), so
that all workers of all clusters hold identical parameters at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nebula_cli.runtime.cluster_share import ClusterShare, Shared

log = logging.getLogger("nebula.sync")


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


def final_agreement(averager: Any, cluster: ClusterShare, apply: Callable[[Shared], bool],
                    write: Callable[[], None], stats: dict[str, Any] | None
                    ) -> dict[str, Any] | None:
    """On every rank, after the last round: take the final state every cluster ends with when
    it is not ours (``averager``: rank 0's, None elsewhere). ``apply`` sets theta_global (and
    the outer momentum) from it, ``write`` puts theta_global into the parameters. Returns
    ``stats`` with ``final_state_round`` when a state was taken."""
    taken = None
    ask = getattr(averager, "final_state", None)
    if ask is not None:
        try:
            round_id, theta, momentum = ask(None)
            if theta is not None:
                taken = _FinalState(int(round_id), theta, momentum)
        except Exception as exc:  # the run is over: keep this cluster's parameters, say so
            log.warning("could not agree on the final state with the other clusters: %s "
                        "(this cluster keeps its own)", exc)
    flag = torch.tensor([0.0 if taken is None else 1.0], dtype=torch.float64)
    cluster.broadcast(flag)
    if flag.item() != 1.0:
        return stats
    shared = cluster.share(-1, taken, None)
    apply(shared)
    write()
    log.info("took the final state of the cluster that finished last (after its round %d)",
             shared.round_id)
    return {**(stats or {}), "final_state_round": shared.round_id}
