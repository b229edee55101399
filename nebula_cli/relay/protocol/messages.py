"""The round protocol's messages between relays, typed.

- Round control (ROUND frames, told apart by ``op``): :class:`Ready` (a cluster is ready for a
  round), the coordinator's :class:`~nebula_cli.relay.protocol.agreement.Decision` (START),
  :class:`Behind` (that round is over: catch up), :class:`Abort` (an exchange failed).
- One encoded chunk of a round's exchange (PEER_CHUNK): :class:`PeerChunk`.
- Catch-up transfers (:mod:`nebula_cli.relay.protocol.fetch`): a :class:`ResultAsk` or a
  :class:`StateAsk` (STATE_REQUEST, told apart by ``op``: a :data:`FetchRequest`), answered by
  a :class:`ResultAnswer` or a :class:`StateAnswer` header and then :class:`AnswerChunk`
  frames (RESULT / STATE).

Each message is declared once, a frozen keyword-only dataclass whose fields are its encoding
and its strict decoder (:mod:`nebula_cli.relay.net.schema`: MessageError says what is wrong),
called by the relay where the frame is received (``decode_round``, ``PeerChunk.from_frame``,
``decode_fetch``, ``decode_answer``); nothing past that reads a meta dict. The keys on the
wire are those of protocol 2 (see ``relay.net.peers.PROTOCOL``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from nebula_cli.relay.codecs.base import CodecError, Encoded
from nebula_cli.relay.net.limits import held_size
from nebula_cli.relay.net.schema import MessageError, choice_of, decode, encode, wire
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


@dataclass(frozen=True, kw_only=True)
class Ready:
    """Cluster is ready for attempt ``attempt`` of round ``round`` (to the coordinator)."""

    NAME: ClassVar[str] = "READY"

    round: int
    attempt: int = wire(low=0, high=MAX_ATTEMPTS - 1)
    ok: bool
    """Its contribution can be sent (False: rejected, ``reason`` says why)."""
    numel: int = wire(low=0)
    reason: str = ""
    lineage: str = UNKNOWN
    """Its lineage as the round starts (see relay.protocol.lineage)."""
    info: RoundInfo = RoundInfo()
    """What its worker said of its round (relay.protocol.pacing)."""
    codec: str = wire("", max_chars=CODEC_CHARS)
    """The codec it encoded with (``compression: auto``)."""
    codec_round: int = -1
    """The round of the decision that named ``codec`` (-1: none since its relay started)."""


@dataclass(frozen=True, kw_only=True)
class Behind:
    """Round ``round`` has been completed by some relay: the receiver catches up."""

    NAME: ClassVar[str] = "BEHIND"

    round: int


@dataclass(frozen=True, kw_only=True)
class Abort:
    """The sender's exchange of (round, attempt, coordinator) failed: so does the receiver's."""

    NAME: ClassVar[str] = "ABORT"

    round: int
    attempt: int
    coord: str
    reason: str = ""

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.round, self.attempt, self.coord)


RoundMessage = Ready | Decision | Behind | Abort
"""What a ROUND frame carries."""

_ROUND_OPS: dict[type, RoundOp] = {Ready: RoundOp.READY, Decision: RoundOp.START,
                                   Behind: RoundOp.BEHIND, Abort: RoundOp.ABORT}
_ROUND_MESSAGES: dict[RoundOp, type] = {op: cls for cls, op in _ROUND_OPS.items()}


def round_frame(msg: RoundMessage) -> Frame:
    """The ROUND frame that carries ``msg``."""
    return Frame(FrameType.ROUND, {"op": _ROUND_OPS[type(msg)].value, **encode(msg)})


def decode_round(meta: object) -> RoundMessage:
    """A ROUND frame's meta as its message (MessageError: malformed, or an unknown op)."""
    return decode(_ROUND_MESSAGES[choice_of("ROUND", meta, "op", RoundOp)], meta)


# ---------------------------------------------------------------------- a round's chunks


class ChunkKind(StrEnum):
    CONTRIB = "contrib"
    """A cluster's encoded chunk, to the relays that average it."""
    AVG = "avg"
    """A chunk's encoded average, from the relay that owns it (shard mode)."""


@dataclass(frozen=True, kw_only=True)
class PeerChunk:
    """Chunk ``k`` of the exchange of (round, attempt, coordinator): an encoding of the round's
    codec, or None for zeros (on the wire ``zero``, else the encoding's own keys and payload)."""

    NAME: ClassVar[str] = "PEER_CHUNK"

    kind: ChunkKind = wire(key="op")
    round: int
    attempt: int
    coord: str
    k: int = wire(low=0)
    enc: Encoded | None = wire(on_wire=False)

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.round, self.attempt, self.coord)

    def to_frame(self) -> Frame:
        meta = encode(self)
        if self.enc is None:
            return Frame(FrameType.PEER_CHUNK, {**meta, "zero": True})
        return Frame(FrameType.PEER_CHUNK, {**meta, **self.enc.wire_meta()}, self.enc.payload)

    def held_size(self) -> int:
        """What holding it costs (relay.net.limits.held_size of its frame)."""
        return held_size(self.to_frame())

    @classmethod
    def from_frame(cls, frame: Frame) -> PeerChunk:
        enc = None
        if not decode(_Zero, frame.meta).zero:
            try:
                enc = Encoded.from_wire(frame.meta, frame.payload)
            except CodecError as exc:
                raise MessageError(f"PEER_CHUNK: {exc}") from None
        return decode(cls, frame.meta, enc=enc)


@dataclass(frozen=True, kw_only=True)
class _Zero:
    """A chunk's flag that it is zeros (read beside its head)."""

    NAME: ClassVar[str] = "PEER_CHUNK"

    zero: bool = False


# ---------------------------------------------------------------------- catch-up transfers


class Fetched(StrEnum):
    """What a fetch asks a peer for."""

    RESULT = "result"
    """A round's average (answered by a ResultAnswer)."""
    STATE = "state"
    """Its published global state (answered by a StateAnswer)."""


@dataclass(frozen=True, kw_only=True)
class ResultAsk:
    """Ask a peer for round ``round``'s average; ``wait``: how long it may wait for it (None:
    as long as it allows); ``req`` is set by the fetcher that sends it."""

    NAME: ClassVar[str] = "STATE_REQUEST"
    TAG: ClassVar[tuple[str, str]] = ("op", Fetched.RESULT.value)
    what: ClassVar[Fetched] = Fetched.RESULT

    round: int
    wait: float | None = wire(None, low=0.0, omit_default=True)
    req: int = wire(0, required=True)


@dataclass(frozen=True, kw_only=True)
class StateAsk:
    """Ask a peer for its global state of at least round ``min_round``; ``wait``: how long it
    may wait for one (None: not at all); ``req`` is set by the fetcher that sends it."""

    NAME: ClassVar[str] = "STATE_REQUEST"
    TAG: ClassVar[tuple[str, str]] = ("op", Fetched.STATE.value)
    what: ClassVar[Fetched] = Fetched.STATE

    min_round: int = -1
    wait: float | None = wire(None, low=0.0, omit_default=True)
    req: int = wire(0, required=True)


FetchRequest = ResultAsk | StateAsk
"""What a STATE_REQUEST frame from a peer asks."""


def decode_fetch(meta: object) -> FetchRequest:
    """A peer's STATE_REQUEST meta as its request (MessageError: malformed, or an unknown op)."""
    what = choice_of("STATE_REQUEST", meta, "op", Fetched)
    return decode(ResultAsk if what == Fetched.RESULT else StateAsk, meta)


class AnswerStatus(StrEnum):
    OK = "ok"
    """The answer's tensor follows."""
    NONE = "none"
    """The peer has nothing to give."""
    BUSY = "busy"
    """The peer serves as many requests of this relay as it allows."""


def _ok(values: Any) -> bool:
    """An answer's fields past its status are there when it is OK."""
    return values["status"] == AnswerStatus.OK


@dataclass(frozen=True, kw_only=True)
class ResultAnswer:
    """The header of a peer's answer to a RESULT fetch (with OK: ``numel`` fp32 follow)."""

    NAME: ClassVar[str] = "RESULT"

    req: int
    status: AnswerStatus
    round: int = wire(-1, when=_ok, required=True)
    present: tuple[str, ...] = wire((), when=_ok)
    rejected: tuple[str, ...] = wire((), when=_ok)
    codec: str = wire("", when=_ok, max_chars=CODEC_CHARS)
    numel: int = wire(0, when=_ok, required=True, low=0)


@dataclass(frozen=True, kw_only=True)
class StateAnswer:
    """The header of a peer's answer to a STATE fetch (with OK: ``numel`` fp32 follow:
    theta_global, then with ``parts`` 2 the outer momentum)."""

    NAME: ClassVar[str] = "STATE"

    req: int
    status: AnswerStatus
    round: int = wire(-1, when=_ok, required=True)
    lineage: str = wire(UNKNOWN, when=_ok)
    parts: int = wire(1, when=_ok, choices=STATE_PARTS)
    numel: int = wire(0, when=_ok, required=True, low=0)


@dataclass(frozen=True, kw_only=True)
class AnswerChunk:
    """fp32 elements of an answer from element ``lo`` on (after its header)."""

    req: int
    lo: int = wire(low=0)
    payload: Buffer = wire(on_wire=False)


def decode_answer(frame: Frame) -> ResultAnswer | StateAnswer | AnswerChunk:
    """A RESULT or STATE frame from a peer: an answer's header (it has a status) or one of
    its chunks."""
    what = frame.type.name
    if "status" in frame.meta:
        return decode(ResultAnswer if frame.type == FrameType.RESULT else StateAnswer,
                      frame.meta)
    return decode(AnswerChunk, frame.meta, what=what, payload=frame.payload)
