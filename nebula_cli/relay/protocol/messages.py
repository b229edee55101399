"""The round protocol's messages between relays, typed.

- Round control (ROUND frames, told apart by ``op``): :class:`Ready` (a cluster is ready for a
  round), the coordinator's :class:`~nebula_cli.relay.protocol.agreement.Decision` (START),
  :class:`Behind` (that round is over: catch up), :class:`Abort` (an exchange failed).
- One encoded chunk of a round's exchange (PEER_CHUNK): :class:`PeerChunk`.
- Catch-up transfers (:mod:`nebula_cli.relay.protocol.fetch`): a :class:`FetchRequest`
  (STATE_REQUEST), answered by a :class:`ResultAnswer` or a :class:`StateAnswer` header and
  then :class:`AnswerChunk` frames (RESULT / STATE).

Each message is a frozen dataclass with ``to_meta`` or ``to_frame`` for the sender and one
strict decoder (:mod:`nebula_cli.relay.net.schema`: MessageError says what is wrong), called
by the relay where the frame is received (``decode_round``, ``PeerChunk.from_frame``,
``FetchRequest.from_meta``, ``decode_answer``); nothing past that reads a meta dict. The keys
on the wire are those of protocol 2 (see ``relay.net.peers.PROTOCOL``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from nebula_cli.relay.codecs.base import CodecError, Encoded
from nebula_cli.relay.net.limits import held_size
from nebula_cli.relay.net.schema import Fields, MessageError
from nebula_cli.relay.net.wire import Buffer, Frame, FrameType
from nebula_cli.relay.protocol.agreement import Decision
from nebula_cli.relay.protocol.lineage import UNKNOWN
from nebula_cli.relay.protocol.pacing import CODEC_CHARS, RoundInfo
from nebula_cli.relay.protocol.results import STATE_PARTS

MAX_ATTEMPTS = 3
"""Attempts of one round (a present peer gone mid-exchange: the survivors redo it); a READY
for an attempt beyond them is refused."""

# ---------------------------------------------------------------------- round control


class RoundOp(StrEnum):
    READY = "ready"
    START = "start"
    BEHIND = "behind"
    ABORT = "abort"


@dataclass(frozen=True)
class Ready:
    """Cluster is ready for attempt ``attempt`` of round ``round`` (to the coordinator)."""

    round: int
    attempt: int
    ok: bool
    """Its contribution can be sent (False: rejected, ``reason`` says why)."""
    numel: int
    reason: str = ""
    lineage: str = UNKNOWN
    """Its lineage as the round starts (see relay.protocol.lineage)."""
    info: RoundInfo = RoundInfo()
    """What its worker said of its round (relay.protocol.pacing)."""
    codec: str = ""
    """The codec it encoded with (``compression: auto``)."""
    codec_round: int = -1
    """The round of the decision that named ``codec`` (-1: none since its relay started)."""

    def to_meta(self) -> dict[str, Any]:
        return {"round": self.round, "attempt": self.attempt, "ok": self.ok,
                "numel": self.numel, "reason": self.reason, "lineage": self.lineage,
                "info": self.info.to_meta(), "codec": self.codec,
                "codec_round": self.codec_round}

    @classmethod
    def from_meta(cls, meta: object) -> Ready:
        f = Fields("READY", meta)
        return cls(f.integer("round"), f.integer("attempt", low=0, high=MAX_ATTEMPTS - 1),
                   f.flag("ok"), f.integer("numel", low=0), f.text("reason", ""),
                   f.text("lineage", UNKNOWN), RoundInfo.from_meta(f.raw("info")),
                   f.text("codec", "", max_chars=CODEC_CHARS), f.integer("codec_round", -1))


@dataclass(frozen=True)
class Behind:
    """Round ``round`` has been completed by some relay: the receiver catches up."""

    round: int

    def to_meta(self) -> dict[str, Any]:
        return {"round": self.round}

    @classmethod
    def from_meta(cls, meta: object) -> Behind:
        return cls(Fields("BEHIND", meta).integer("round"))


@dataclass(frozen=True)
class Abort:
    """The sender's exchange of (round, attempt, coordinator) failed: so does the receiver's."""

    round: int
    attempt: int
    coord: str
    reason: str = ""

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.round, self.attempt, self.coord)

    def to_meta(self) -> dict[str, Any]:
        return {"round": self.round, "attempt": self.attempt, "coord": self.coord,
                "reason": self.reason}

    @classmethod
    def from_meta(cls, meta: object) -> Abort:
        f = Fields("ABORT", meta)
        return cls(f.integer("round"), f.integer("attempt"), f.text("coord"),
                   f.text("reason", ""))


RoundMessage = Ready | Decision | Behind | Abort
"""What a ROUND frame carries."""

_ROUND_OPS: dict[type, RoundOp] = {Ready: RoundOp.READY, Decision: RoundOp.START,
                                   Behind: RoundOp.BEHIND, Abort: RoundOp.ABORT}


def round_frame(msg: RoundMessage) -> Frame:
    """The ROUND frame that carries ``msg``."""
    return Frame(FrameType.ROUND, {"op": _ROUND_OPS[type(msg)].value, **msg.to_meta()})


def decode_round(meta: object) -> RoundMessage:
    """A ROUND frame's meta as its message (MessageError: malformed, or an unknown op)."""
    op = Fields("ROUND", meta).choice("op", RoundOp)
    if op == RoundOp.READY:
        return Ready.from_meta(meta)
    if op == RoundOp.START:
        return Decision.from_meta(meta)  # type: ignore[arg-type]
    if op == RoundOp.BEHIND:
        return Behind.from_meta(meta)
    return Abort.from_meta(meta)


# ---------------------------------------------------------------------- a round's chunks


class ChunkKind(StrEnum):
    CONTRIB = "contrib"
    """A cluster's encoded chunk, to the relays that average it."""
    AVG = "avg"
    """A chunk's encoded average, from the relay that owns it (shard mode)."""


@dataclass(frozen=True)
class PeerChunk:
    """Chunk ``k`` of the exchange of (round, attempt, coordinator): an encoding of the round's
    codec, or None for zeros."""

    kind: ChunkKind
    round: int
    attempt: int
    coord: str
    k: int
    enc: Encoded | None

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.round, self.attempt, self.coord)

    def to_frame(self) -> Frame:
        meta = {"op": self.kind.value, "round": self.round, "attempt": self.attempt,
                "coord": self.coord, "k": self.k}
        if self.enc is None:
            return Frame(FrameType.PEER_CHUNK, {**meta, "zero": True})
        return Frame(FrameType.PEER_CHUNK, {**meta, **self.enc.wire_meta()}, self.enc.payload)

    def held_size(self) -> int:
        """What holding it costs (relay.net.limits.held_size of its frame)."""
        return held_size(self.to_frame())

    @classmethod
    def from_frame(cls, frame: Frame) -> PeerChunk:
        f = Fields("PEER_CHUNK", frame.meta)
        head = (f.choice("op", ChunkKind), f.integer("round"), f.integer("attempt"),
                f.text("coord"), f.integer("k", low=0))
        if f.flag("zero", False):
            return cls(*head, None)
        try:
            enc = Encoded.from_wire(frame.meta, frame.payload)
        except CodecError as exc:
            raise MessageError(f"PEER_CHUNK: {exc}") from None
        return cls(*head, enc)


# ---------------------------------------------------------------------- catch-up transfers


class Fetched(StrEnum):
    """What a fetch asks a peer for."""

    RESULT = "result"
    """A round's average (answered by a ResultAnswer)."""
    STATE = "state"
    """Its published global state (answered by a StateAnswer)."""


@dataclass(frozen=True)
class FetchRequest:
    """Ask a peer for round ``round``'s average, or for its global state of at least round
    ``round``; ``wait``: how long it may wait for one (None: as long as it allows for a
    result, not at all for a state); ``req`` is set by the fetcher that sends it."""

    what: Fetched
    round: int
    wait: float | None = None
    req: int = 0

    def to_meta(self) -> dict[str, Any]:
        if self.what == Fetched.RESULT:
            meta: dict[str, Any] = {"op": self.what.value, "round": self.round}
        else:
            meta = {"op": self.what.value, "min_round": self.round}
        if self.wait is not None:
            meta["wait"] = self.wait
        return {**meta, "req": self.req}

    @classmethod
    def from_meta(cls, meta: object) -> FetchRequest:
        f = Fields("STATE_REQUEST", meta)
        what = f.choice("op", Fetched)
        return cls(what, f.integer("round") if what == Fetched.RESULT
                   else f.integer("min_round", -1), f.number("wait", None, low=0.0),
                   f.integer("req"))


class AnswerStatus(StrEnum):
    OK = "ok"
    """The answer's tensor follows."""
    NONE = "none"
    """The peer has nothing to give."""
    BUSY = "busy"
    """The peer serves as many requests of this relay as it allows."""


@dataclass(frozen=True)
class ResultAnswer:
    """The header of a peer's answer to a RESULT fetch (with OK: ``numel`` fp32 follow)."""

    req: int
    status: AnswerStatus
    round: int = -1
    present: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()
    codec: str = ""
    numel: int = 0

    def to_meta(self) -> dict[str, Any]:
        if self.status != AnswerStatus.OK:
            return {"req": self.req, "status": self.status.value}
        return {"req": self.req, "status": self.status.value, "round": self.round,
                "present": list(self.present), "rejected": list(self.rejected),
                "codec": self.codec, "numel": self.numel}

    @classmethod
    def from_meta(cls, meta: object) -> ResultAnswer:
        f = Fields("RESULT", meta)
        req, status = f.integer("req"), f.choice("status", AnswerStatus)
        if status != AnswerStatus.OK:
            return cls(req, status)
        return cls(req, status, f.integer("round"), f.texts("present", ()),
                   f.texts("rejected", ()), f.text("codec", "", max_chars=CODEC_CHARS),
                   f.integer("numel", low=0))


@dataclass(frozen=True)
class StateAnswer:
    """The header of a peer's answer to a STATE fetch (with OK: ``numel`` fp32 follow:
    theta_global, then with ``parts`` 2 the outer momentum)."""

    req: int
    status: AnswerStatus
    round: int = -1
    lineage: str = UNKNOWN
    parts: int = 1
    numel: int = 0

    def to_meta(self) -> dict[str, Any]:
        if self.status != AnswerStatus.OK:
            return {"req": self.req, "status": self.status.value}
        return {"req": self.req, "status": self.status.value, "round": self.round,
                "lineage": self.lineage, "parts": self.parts, "numel": self.numel}

    @classmethod
    def from_meta(cls, meta: object) -> StateAnswer:
        f = Fields("STATE", meta)
        req, status = f.integer("req"), f.choice("status", AnswerStatus)
        if status != AnswerStatus.OK:
            return cls(req, status)
        parts = f.integer("parts", 1)
        if parts not in STATE_PARTS:
            raise f.error("parts", f"one of {STATE_PARTS}")
        return cls(req, status, f.integer("round"), f.text("lineage", UNKNOWN), parts,
                   f.integer("numel", low=0))


@dataclass(frozen=True)
class AnswerChunk:
    """fp32 elements of an answer from element ``lo`` on (after its header)."""

    req: int
    lo: int
    payload: Buffer


def decode_answer(frame: Frame) -> ResultAnswer | StateAnswer | AnswerChunk:
    """A RESULT or STATE frame from a peer: an answer's header (it has a status) or one of
    its chunks."""
    f = Fields(frame.type.name, frame.meta)
    if "status" in frame.meta:
        return (ResultAnswer if frame.type == FrameType.RESULT else StateAnswer).from_meta(
            frame.meta)
    return AnswerChunk(f.integer("req"), f.integer("lo", low=0), frame.payload)
