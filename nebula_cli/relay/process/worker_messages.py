"""The worker hop's messages, typed: what a cluster's rank 0
(:class:`~nebula_cli.relay.process.client.RelayClient`) asks of its relay
(:class:`~nebula_cli.relay.process.worker_port.WorkerPort`), and what the relay answers.

Asked (:func:`decode_request` reads them where the relay receives them):
:class:`WorkerHello`, :class:`Contrib` (a round's contribution), :class:`Publish` (a global
state), :class:`FetchState`, :class:`FinalState`, :class:`Bye`. Answered (read by the client
where it receives them): :class:`WorkerWelcome`, :class:`RoundReply` (a round's RESULT, with
the :class:`~nebula_cli.relay.protocol.next_round.NextRound` the relays agreed, whole),
:class:`StateReply`, or a refusal (``relay.net.messages.Refusal``). A message that carries a
tensor says its size (``numel``); the tensor follows as :mod:`nebula_cli.relay.net.framing`
lays it out. Each message is declared once, its fields its encoding and its strict decoder
(:mod:`nebula_cli.relay.net.schema`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from nebula_cli.relay.net.limits import LimitExceeded, SyncSize
from nebula_cli.relay.net.messages import RelayProgress
from nebula_cli.relay.net.schema import MessageError, choice_of, decode, encode, wire
from nebula_cli.relay.net.wire import Frame, FrameType
from nebula_cli.relay.protocol.next_round import NextRound
from nebula_cli.relay.protocol.pacing import CODEC_CHARS, RoundInfo
from nebula_cli.relay.protocol.results import STATE_PARTS, RoundMode, RoundOutcome

# ---------------------------------------------------------------------- asked by the worker


def _layout(v: Any) -> SyncSize:
    """A worker's stated layout (MessageError: malformed or too large)."""
    try:
        return SyncSize.from_layout(v)
    except LimitExceeded as exc:
        raise MessageError(str(exc)) from None


@dataclass(frozen=True, kw_only=True)
class WorkerHello:
    """The first frame of a worker's connection: its cluster and job (checked against the
    relay's), and what it syncs (``layout``: the first registration fixes the sync size)."""

    NAME: ClassVar[str] = "HELLO"
    TAG: ClassVar[tuple[str, str]] = ("role", "worker")

    cluster: str | None = None
    job_id: str | None = None
    layout: SyncSize | None = wire(None, omit_default=True, to_wire=SyncSize.to_layout,
                                   from_wire=_layout)

    def to_frame(self) -> Frame:
        return Frame(FrameType.HELLO, encode(self))


class WorkerOp(StrEnum):
    ALLREDUCE = "allreduce"
    """CONTRIB: a round's contribution."""
    PUBLISH = "publish"
    """STATE: a global state to serve to peers."""
    FETCH = "fetch"
    """STATE_REQUEST: the newest global state known."""
    FINAL = "final"
    """STATE_REQUEST: the state to end with."""


@dataclass(frozen=True, kw_only=True)
class Contrib:
    """This cluster's contribution to round ``round`` (``numel`` fp32 follow). ``info``: what
    the worker says of its round; ``released``: tokens of averages in shared memory it no
    longer maps (the local socket)."""

    NAME: ClassVar[str] = "CONTRIB"
    TAG: ClassVar[tuple[str, str]] = ("op", WorkerOp.ALLREDUCE.value)

    round: int = wire(low=0)
    numel: int = wire(low=0)
    info: RoundInfo = wire(RoundInfo(), omit_default=True)
    released: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Publish:
    """theta_global after round ``round`` (``numel`` fp32 follow: theta alone, ``parts`` 1, or
    theta then the outer momentum, ``parts`` 2)."""

    NAME: ClassVar[str] = "STATE"
    TAG: ClassVar[tuple[str, str]] = ("op", WorkerOp.PUBLISH.value)

    round: int
    parts: int = wire(1, choices=STATE_PARTS, error="a tensor in {!r} parts")
    numel: int = wire(low=0)


@dataclass(frozen=True, kw_only=True)
class FetchState:
    """The newest global state this relay or a connected peer holds."""

    NAME: ClassVar[str] = "STATE_REQUEST"
    TAG: ClassVar[tuple[str, str]] = ("op", WorkerOp.FETCH.value)

    def to_frame(self) -> Frame:
        return Frame(FrameType.STATE_REQUEST, encode(self))


@dataclass(frozen=True, kw_only=True)
class FinalState:
    """This cluster's workers are done: once every connected cluster is (at most ``wait``
    seconds; None: as long as a peer trains), the state to end with."""

    NAME: ClassVar[str] = "STATE_REQUEST"
    TAG: ClassVar[tuple[str, str]] = ("op", WorkerOp.FINAL.value)

    wait: float | None = None

    def to_frame(self) -> Frame:
        return Frame(FrameType.STATE_REQUEST, encode(self))


@dataclass(frozen=True, kw_only=True)
class Bye:
    """Rank 0 closed its client: its training is over."""


WorkerRequest = WorkerHello | Contrib | Publish | FetchState | FinalState | Bye

_REQUESTS: dict[tuple[FrameType, WorkerOp], type] = {
    (FrameType.CONTRIB, WorkerOp.ALLREDUCE): Contrib,
    (FrameType.STATE, WorkerOp.PUBLISH): Publish,
    (FrameType.STATE_REQUEST, WorkerOp.FETCH): FetchState,
    (FrameType.STATE_REQUEST, WorkerOp.FINAL): FinalState}


def decode_request(frame: Frame) -> WorkerRequest:
    """What a worker's frame asks (MessageError: malformed, or not a request)."""
    t, m = frame.type, frame.meta
    if t == FrameType.HELLO:
        return decode(WorkerHello, m)
    if t == FrameType.BYE:
        return Bye()
    op = choice_of(t.name, m, "op", WorkerOp, None) if t in (
        FrameType.CONTRIB, FrameType.STATE, FrameType.STATE_REQUEST) else None
    cls = _REQUESTS.get((t, op)) if op is not None else None
    if cls is None:
        raise MessageError(f"unexpected {t.name} frame {op or ''}".rstrip())
    return decode(cls, m)


# ---------------------------------------------------------------------- answered by the relay


@dataclass(frozen=True, kw_only=True)
class WorkerWelcome:
    """The relay's answer to a worker's HELLO: who it is and how far it is."""

    NAME: ClassVar[str] = "WELCOME"

    cluster: str
    clusters: tuple[str, ...]
    codec: str
    round_timeout: float
    progress: RelayProgress = wire(RelayProgress(), flat=True)


@dataclass(frozen=True, kw_only=True)
class RoundReply:
    """The header of a round's RESULT (``numel`` fp32 of the average follow; on the local
    socket as the shared memory ``shm`` lends, until the worker releases it; with
    ``has_state`` a :class:`StateReply` and a peer's global state after them)."""

    NAME: ClassVar[str] = "RESULT"

    round_id: int
    present: tuple[str, ...] = ()
    next: NextRound = wire(NextRound(), flat=True)
    codec: str = wire("", max_chars=CODEC_CHARS)
    weights: dict[str, float] = wire(factory=dict)
    rejected: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    upload_s: float = 0.0
    has_state: bool = False
    mode: RoundMode = wire(RoundMode.FAILED, required=True)
    numel: int = wire(0, required=True, low=0)
    shm: int | None = wire(None, omit_default=True, low=1)

    @classmethod
    def of(cls, out: RoundOutcome, *, upload_s: float, shm: int | None) -> RoundReply:
        """The reply that tells a worker the outcome ``out`` of its round."""
        return cls(round_id=out.round_id, present=tuple(out.present),
                   rejected=tuple(out.rejected), missing=tuple(out.missing),
                   weights=dict(out.weights), codec=out.codec, next=out.next, mode=out.mode,
                   seconds=out.seconds, bytes_sent=out.bytes_sent,
                   bytes_received=out.bytes_received, upload_s=upload_s,
                   has_state=out.global_state is not None, shm=shm, numel=out.tensor.numel())


class StateOp(StrEnum):
    STORED = "stored"
    """A published state was stored (no tensor)."""
    STATE = "state"
    """The answer to FetchState."""
    FINAL = "final"
    """The answer to FinalState."""


def _has_tensor(values: Any) -> bool:
    """A state reply says its tensor's parts and size when a state follows."""
    return values["round"] is not None and values["op"] != StateOp.STORED


@dataclass(frozen=True, kw_only=True)
class StateReply:
    """A STATE header from the relay: round ``round``'s global state (``numel`` fp32 follow, in
    ``parts`` as a published state), None when there is none to give; ``op`` says what it
    answers (None: the state after a RESULT whose cluster caught up)."""

    NAME: ClassVar[str] = "STATE"

    op: StateOp | None = wire(None, omit_default=True)
    round: int | None = None
    parts: int = wire(1, when=_has_tensor, choices=STATE_PARTS)
    numel: int = wire(0, when=_has_tensor, required=True, low=0)
