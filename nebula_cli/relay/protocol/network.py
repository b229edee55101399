"""The network as the round protocol sees it: a small :class:`Net` protocol that the relay's
peer links implement (:class:`nebula_cli.relay.process.server.Relay` wires them), and that the
tests implement in memory. Nothing in :mod:`nebula_cli.relay.protocol` opens a socket: it
sends frames, fetches from peers and asks who is there through this interface."""

from __future__ import annotations

from typing import Protocol

from nebula_cli.relay.net.wire import Frame
from nebula_cli.relay.protocol.messages import FetchRequest
from nebula_cli.relay.protocol.results import Average, GlobalState


class Net(Protocol):
    """What the round driver needs of the network."""

    def connected(self) -> list[str]:
        """The peer clusters with a live link, in the job's order."""
        ...

    def coordinator(self) -> str:
        """The first cluster in the job's order among this relay and its connected peers."""
        ...

    def peers_done(self) -> int:
        """The newest round a connected peer has completed (-1: none)."""
        ...

    def all_linked_once(self) -> bool:
        """Whether every peer has been connected at least once since this relay started."""
        ...

    def send(self, cluster: str, frame: Frame, *, bulk: bool = False) -> bool:
        """Queue a frame for a peer; False when there is no link to it."""
        ...

    def flush(self, cluster: str, timeout: float) -> None:
        """Wait (at most ``timeout``) until the bulk frames queued for a peer are written."""
        ...

    def fetch(self, cluster: str, ask: FetchRequest, timeout: float
              ) -> Average | GlobalState | None:
        """Ask a peer for a round's average or a global state; None when it has none."""
        ...

    def holders(self, round_id: int) -> list[str]:
        """Connected peers that hold the average of ``round_id``."""
        ...

    def state_sources(self) -> list[tuple[str, int | None]]:
        """Connected peers and the round of the global state each publishes, newest first."""
        ...

    def wan_bytes(self) -> tuple[int, int]:
        """Bytes sent to and received from peers so far."""
        ...

    def finish_view(self) -> dict[str, tuple[int | None, str | None, int]]:
        """Connected peers: (the round their workers finished at or None, their lineage,
        their newest round)."""
        ...

    def departed(self) -> frozenset[str]:
        """Peers not connected whose relay said, as it went, that its cluster left the job for
        good (nebula dropped it): the end does not wait for them."""
        ...
