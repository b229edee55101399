"""The messages of a peer link itself, typed: a relay's progress (in its HELLO or WELCOME and
in every heartbeat), the hello's identity, round-trip pings, a goodbye and a refusal.

Each is declared once, a frozen keyword-only dataclass whose fields are its encoding
(:func:`nebula_cli.relay.net.schema.encode`) and its strict decoder
(:func:`~nebula_cli.relay.net.schema.decode`), called where the frame is received; the rest of
the relay reads the dataclass. The round protocol's own messages are in
:mod:`nebula_cli.relay.protocol.messages`, the worker hop's in
:mod:`nebula_cli.relay.process.worker_messages`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from nebula_cli.relay.net.limits import SyncSize
from nebula_cli.relay.net.schema import MessageError, choice_of, decode, encode, wire
from nebula_cli.relay.net.wire import Frame, FrameType


@dataclass(frozen=True, kw_only=True)
class RelayProgress:
    """How far a relay is, as its peers see it (HELLO, WELCOME, heartbeats)."""

    NAME: ClassVar[str] = "progress"

    done: int = wire(-1, low=-1)
    """The newest round it completed (-1: none)."""
    state_round: int | None = None
    """The round of the global state it publishes (None: none)."""
    result_round: int | None = None
    """The round of the average it holds (None: none)."""
    sync: SyncSize | None = wire(None, to_wire=SyncSize.to_meta, read=False)
    """What its cluster syncs, stated to peers for their status (sent as
    ``SyncSize.to_meta()``; a peer's is not read back: None once received)."""
    finished: int | None = None
    """The round its cluster's workers finished at (None while they train)."""
    lineage: str | None = None
    """Its lineage (see relay.protocol.lineage; None before its first round)."""


@dataclass(frozen=True, kw_only=True)
class PeerHello:
    """A relay's HELLO (or its peer's WELCOME) as read: who sent it, how far it is, and its
    offer of AES-GCM records (read by ``gcm_records.accepted``). The settings both ends must
    share are checked on the frame's meta by ``Peers.incompatible``, where it is received."""

    NAME: ClassVar[str] = "HELLO"

    cluster: str
    progress: RelayProgress = wire(RelayProgress(), flat=True)
    records: Any = None


class HeartbeatOp(StrEnum):
    PING = "ping"
    PONG = "pong"


@dataclass(frozen=True, kw_only=True)
class Ping:
    """Asks the peer for a :class:`Pong` with the same id (a round-trip time)."""

    NAME: ClassVar[str] = "HEARTBEAT"
    TAG: ClassVar[tuple[str, str]] = ("op", HeartbeatOp.PING.value)

    id: int

    def to_frame(self) -> Frame:
        return Frame(FrameType.HEARTBEAT, encode(self))


@dataclass(frozen=True, kw_only=True)
class Pong:
    NAME: ClassVar[str] = "HEARTBEAT"
    TAG: ClassVar[tuple[str, str]] = ("op", HeartbeatOp.PONG.value)

    id: int

    def to_frame(self) -> Frame:
        return Frame(FrameType.HEARTBEAT, encode(self))


def decode_heartbeat(meta: object) -> Ping | Pong | RelayProgress:
    """A HEARTBEAT frame's meta: a ping, a pong, or (no op) the sender's progress."""
    op = choice_of("HEARTBEAT", meta, "op", HeartbeatOp, None)
    if op is None:
        return decode(RelayProgress, meta, what="HEARTBEAT")
    return decode(Ping if op == HeartbeatOp.PING else Pong, meta)


@dataclass(frozen=True, kw_only=True)
class Goodbye:
    """A BYE frame: the sender closes the link. ``leaving``: its cluster has left the job for
    good (nebula dropped it, or every cluster has finished), so that its peers do not wait for
    it at the end; a relay that is only stopped (a `nebula stop`, a host shutting down, a
    scheduler's notice, its agent replaced) may come back, and says False."""

    NAME: ClassVar[str] = "BYE"

    leaving: bool = False

    def to_frame(self) -> Frame:
        return Frame(FrameType.BYE, encode(self))

    @classmethod
    def read(cls, meta: object) -> Goodbye:
        """Whatever the sender said; a goodbye without a word (older relays) is not leaving."""
        try:
            return decode(cls, meta)
        except MessageError:
            return cls()


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """An ERROR frame: why the sender refuses (it closes the connection after)."""

    NAME: ClassVar[str] = "ERROR"

    reason: str = ""

    def to_frame(self) -> Frame:
        return Frame(FrameType.ERROR, encode(self))

    @classmethod
    def read(cls, meta: object) -> Refusal:
        """Whatever the sender said (a refusal is shown, never refused)."""
        try:
            return decode(cls, meta)
        except MessageError:
            return cls(reason=repr(meta.get("reason") if isinstance(meta, dict) else meta))
