"""The messages of a peer link itself, typed: a relay's progress (in its HELLO or WELCOME and
in every heartbeat), the hello's identity, round-trip pings, a goodbye and a refusal.

Each is a frozen dataclass with ``to_meta`` (what the sender puts in the frame) and one
strict ``from_meta`` (:mod:`nebula_cli.relay.net.schema`), called where the frame is received;
the rest of the relay reads the dataclass. The round protocol's own messages are in
:mod:`nebula_cli.relay.protocol.messages`, the worker hop's in
:mod:`nebula_cli.relay.process.worker_messages`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from nebula_cli.relay.net.limits import SyncSize
from nebula_cli.relay.net.schema import Fields, MessageError
from nebula_cli.relay.net.wire import Frame, FrameType


@dataclass(frozen=True)
class Progress:
    """How far a relay is, as its peers see it (HELLO, WELCOME, heartbeats)."""

    done: int = -1
    """The newest round it completed (-1: none)."""
    state_round: int | None = None
    """The round of the global state it publishes (None: none)."""
    result_round: int | None = None
    """The round of the average it holds (None: none)."""
    finished: int | None = None
    """The round its cluster's workers finished at (None while they train)."""
    lineage: str | None = None
    """Its lineage (see relay.protocol.lineage; None before its first round)."""
    sync: SyncSize | None = None
    """What its cluster syncs, stated to peers for their status (sent as
    ``SyncSize.to_meta()``; a peer's is not read back: None once received)."""

    def to_meta(self) -> dict[str, Any]:
        return {"done": self.done, "state_round": self.state_round,
                "result_round": self.result_round,
                "sync": self.sync.to_meta() if self.sync else None,
                "finished": self.finished, "lineage": self.lineage}

    @classmethod
    def from_meta(cls, meta: object, what: str = "progress") -> Progress:
        f = Fields(what, meta)
        return cls(f.integer("done", -1, low=-1), f.integer("state_round", None),
                   f.integer("result_round", None), f.integer("finished", None),
                   f.text("lineage", None))


@dataclass(frozen=True)
class PeerHello:
    """A relay's HELLO (or its peer's WELCOME) as read: who sent it, how far it is, and its
    offer of AES-GCM records (read by ``gcm_records.accepted``). The settings both ends must
    share are checked on the frame's meta by ``Peers.incompatible``, where it is received."""

    cluster: str
    progress: Progress
    records: Any = None

    @classmethod
    def from_meta(cls, meta: object, what: str = "HELLO") -> PeerHello:
        f = Fields(what, meta)
        return cls(f.text("cluster"), Progress.from_meta(meta, what), f.raw("records"))


class HeartbeatOp(StrEnum):
    PING = "ping"
    PONG = "pong"


@dataclass(frozen=True)
class Ping:
    """Asks the peer for a :class:`Pong` with the same id (a round-trip time)."""

    id: int

    def to_frame(self) -> Frame:
        return Frame(FrameType.HEARTBEAT, {"op": HeartbeatOp.PING.value, "id": self.id})


@dataclass(frozen=True)
class Pong:
    id: int

    def to_frame(self) -> Frame:
        return Frame(FrameType.HEARTBEAT, {"op": HeartbeatOp.PONG.value, "id": self.id})


def decode_heartbeat(meta: object) -> Ping | Pong | Progress:
    """A HEARTBEAT frame's meta: a ping, a pong, or (no op) the sender's progress."""
    f = Fields("HEARTBEAT", meta)
    op = f.choice("op", HeartbeatOp, None)
    if op is None:
        return Progress.from_meta(meta, "HEARTBEAT")
    return (Ping if op == HeartbeatOp.PING else Pong)(f.integer("id"))


@dataclass(frozen=True)
class Goodbye:
    """A BYE frame: the sender closes the link. ``leaving``: its cluster has left the job for
    good (nebula dropped it, or every cluster has finished), so that its peers do not wait for
    it at the end; a relay that is only stopped (a `nebula stop`, a host shutting down, a
    scheduler's notice, its agent replaced) may come back, and says False."""

    leaving: bool = False

    def to_frame(self) -> Frame:
        return Frame(FrameType.BYE, {"leaving": self.leaving})

    @classmethod
    def from_meta(cls, meta: object) -> Goodbye:
        """Whatever the sender said; a goodbye without a word (older relays) is not leaving."""
        try:
            return cls(bool(Fields("BYE", meta).flag("leaving", False)))
        except MessageError:
            return cls()


@dataclass(frozen=True)
class Refusal:
    """An ERROR frame: why the sender refuses (it closes the connection after)."""

    reason: str

    def to_frame(self) -> Frame:
        return Frame(FrameType.ERROR, {"reason": self.reason})

    @classmethod
    def from_meta(cls, meta: object) -> Refusal:
        """Whatever the sender said (a refusal is shown, never refused)."""
        try:
            return cls(Fields("ERROR", meta).text("reason", ""))
        except MessageError:
            return cls(repr(meta.get("reason") if isinstance(meta, dict) else meta))
