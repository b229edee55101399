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
lays it out. Each message has one strict decoder (:mod:`nebula_cli.relay.net.schema`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from nebula_cli.relay.net.limits import LimitExceeded, SyncSize
from nebula_cli.relay.net.messages import Progress
from nebula_cli.relay.net.schema import Fields, MessageError, decode, encode, is_int
from nebula_cli.relay.net.wire import Frame, FrameType
from nebula_cli.relay.protocol.next_round import NextRound
from nebula_cli.relay.protocol.pacing import CODEC_CHARS, RoundInfo
from nebula_cli.relay.protocol.results import STATE_PARTS, RoundMode, RoundOutcome

# ---------------------------------------------------------------------- asked by the worker


@dataclass(frozen=True)
class WorkerHello:
    """The first frame of a worker's connection: its cluster and job (checked against the
    relay's), and what it syncs (``layout``: the first registration fixes the sync size)."""

    cluster: str | None = None
    job_id: str | None = None
    layout: SyncSize | None = None

    def to_frame(self) -> Frame:
        meta: dict[str, Any] = {"role": "worker", "cluster": self.cluster,
                                "job_id": self.job_id}
        if self.layout is not None:
            meta["layout"] = self.layout.to_layout()
        return Frame(FrameType.HELLO, meta)

    @classmethod
    def from_meta(cls, meta: object) -> WorkerHello:
        f = Fields("HELLO", meta)
        layout = f.raw("layout")
        try:
            size = None if layout is None else SyncSize.from_layout(layout)
        except LimitExceeded as exc:
            raise MessageError(str(exc)) from None
        return cls(f.text("cluster", None), f.text("job_id", None), size)


class WorkerOp(StrEnum):
    ALLREDUCE = "allreduce"
    """CONTRIB: a round's contribution."""
    PUBLISH = "publish"
    """STATE: a global state to serve to peers."""
    FETCH = "fetch"
    """STATE_REQUEST: the newest global state known."""
    FINAL = "final"
    """STATE_REQUEST: the state to end with."""


@dataclass(frozen=True)
class Contrib:
    """This cluster's contribution to round ``round`` (``numel`` fp32 follow). ``info``: what
    the worker says of its round; ``released``: tokens of averages in shared memory it no
    longer maps (the local socket)."""

    round: int
    numel: int
    info: RoundInfo = RoundInfo()
    released: tuple[int, ...] = ()

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"op": WorkerOp.ALLREDUCE.value, "round": self.round,
                                "numel": self.numel}
        if self.info != RoundInfo():
            meta["info"] = self.info.to_meta()
        return {**meta, "released": list(self.released)}

    @classmethod
    def from_meta(cls, meta: object) -> Contrib:
        f = Fields("CONTRIB", meta)
        return cls(f.integer("round", low=0), f.integer("numel", low=0),
                   RoundInfo.from_meta(f.raw("info")), f.integers("released", ()))


@dataclass(frozen=True)
class Publish:
    """theta_global after round ``round`` (``numel`` fp32 follow: theta alone, ``parts`` 1, or
    theta then the outer momentum, ``parts`` 2)."""

    round: int
    numel: int
    parts: int = 1

    def to_meta(self) -> dict[str, Any]:
        return {"op": WorkerOp.PUBLISH.value, "round": self.round, "parts": self.parts,
                "numel": self.numel}

    @classmethod
    def from_meta(cls, meta: object) -> Publish:
        f = Fields("STATE", meta)
        parts = f.raw("parts")
        parts = 1 if parts is None else parts
        if not is_int(parts) or parts not in STATE_PARTS:
            raise MessageError(f"a tensor in {parts!r} parts")
        return cls(f.integer("round"), f.integer("numel", low=0), parts)


@dataclass(frozen=True)
class FetchState:
    """The newest global state this relay or a connected peer holds."""

    def to_frame(self) -> Frame:
        return Frame(FrameType.STATE_REQUEST, {"op": WorkerOp.FETCH.value})


@dataclass(frozen=True)
class FinalState:
    """This cluster's workers are done: once every connected cluster is (at most ``wait``
    seconds; None: as long as a peer trains), the state to end with."""

    wait: float | None = None

    def to_frame(self) -> Frame:
        return Frame(FrameType.STATE_REQUEST, {"op": WorkerOp.FINAL.value, "wait": self.wait})


@dataclass(frozen=True)
class Bye:
    """Rank 0 closed its client: its training is over."""


WorkerRequest = WorkerHello | Contrib | Publish | FetchState | FinalState | Bye


def decode_request(frame: Frame) -> WorkerRequest:
    """What a worker's frame asks (MessageError: malformed, or not a request)."""
    t, m = frame.type, frame.meta
    if t == FrameType.HELLO:
        return WorkerHello.from_meta(m)
    if t == FrameType.BYE:
        return Bye()
    op = Fields(t.name, m).choice("op", WorkerOp, None) if t in (
        FrameType.CONTRIB, FrameType.STATE, FrameType.STATE_REQUEST) else None
    if t == FrameType.CONTRIB and op == WorkerOp.ALLREDUCE:
        return Contrib.from_meta(m)
    if t == FrameType.STATE and op == WorkerOp.PUBLISH:
        return Publish.from_meta(m)
    if t == FrameType.STATE_REQUEST and op == WorkerOp.FETCH:
        return FetchState()
    if t == FrameType.STATE_REQUEST and op == WorkerOp.FINAL:
        return FinalState(Fields("STATE_REQUEST", m).number("wait", None))
    raise MessageError(f"unexpected {t.name} frame {op or ''}".rstrip())


# ---------------------------------------------------------------------- answered by the relay


@dataclass(frozen=True)
class WorkerWelcome:
    """The relay's answer to a worker's HELLO: who it is and how far it is."""

    cluster: str
    clusters: tuple[str, ...]
    codec: str
    round_timeout: float
    progress: Progress = Progress()

    def to_meta(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "clusters": list(self.clusters), "codec": self.codec,
                "round_timeout": self.round_timeout, **encode(self.progress)}

    @classmethod
    def from_meta(cls, meta: object) -> WorkerWelcome:
        f = Fields("WELCOME", meta)
        return cls(f.text("cluster"), f.texts("clusters"), f.text("codec"),
                   f.number("round_timeout"), decode(Progress, meta, what="WELCOME"))


@dataclass(frozen=True)
class RoundReply:
    """The header of a round's RESULT (``numel`` fp32 of the average follow; on the local
    socket as the shared memory ``shm`` lends, until the worker releases it; with
    ``has_state`` a :class:`StateReply` and a peer's global state after them)."""

    round_id: int
    present: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    weights: dict[str, float] = field(default_factory=dict)
    codec: str = ""
    next: NextRound = NextRound()
    mode: RoundMode = RoundMode.FAILED
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    upload_s: float = 0.0
    has_state: bool = False
    shm: int | None = None
    numel: int = 0

    @classmethod
    def of(cls, out: RoundOutcome, *, upload_s: float, shm: int | None) -> RoundReply:
        """The reply that tells a worker the outcome ``out`` of its round."""
        return cls(out.round_id, tuple(out.present), tuple(out.rejected), tuple(out.missing),
                   dict(out.weights), out.codec, out.next, out.mode, out.seconds,
                   out.bytes_sent, out.bytes_received, upload_s,
                   out.global_state is not None, shm, out.tensor.numel())

    def to_meta(self) -> dict[str, Any]:
        meta = {"round_id": self.round_id, "present": list(self.present),
                **self.next.to_meta(), "codec": self.codec, "weights": dict(self.weights),
                "rejected": list(self.rejected), "missing": list(self.missing),
                "seconds": self.seconds, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received, "upload_s": self.upload_s,
                "has_state": self.has_state, "mode": self.mode.value, "numel": self.numel}
        if self.shm is not None:
            meta["shm"] = self.shm
        return meta

    @classmethod
    def from_meta(cls, meta: object) -> RoundReply:
        f = Fields("RESULT", meta)
        return cls(f.integer("round_id"), f.texts("present", ()), f.texts("rejected", ()),
                   f.texts("missing", ()), f.numbers("weights", {}),
                   f.text("codec", "", max_chars=CODEC_CHARS),
                   NextRound.from_meta(f.meta, "RESULT"),
                   f.choice("mode", RoundMode), f.number("seconds", 0.0),
                   f.integer("bytes_sent", 0), f.integer("bytes_received", 0),
                   f.number("upload_s", 0.0), f.flag("has_state", False),
                   f.integer("shm", None, low=1), f.integer("numel", low=0))


class StateOp(StrEnum):
    STORED = "stored"
    """A published state was stored (no tensor)."""
    STATE = "state"
    """The answer to FetchState."""
    FINAL = "final"
    """The answer to FinalState."""


@dataclass(frozen=True)
class StateReply:
    """A STATE header from the relay: round ``round``'s global state (``numel`` fp32 follow, in
    ``parts`` as a published state), None when there is none to give; ``op`` says what it
    answers (None: the state after a RESULT whose cluster caught up)."""

    op: StateOp | None
    round: int | None
    parts: int = 1
    numel: int = 0

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {} if self.op is None else {"op": self.op.value}
        meta["round"] = self.round
        if self.round is not None and self.op != StateOp.STORED:
            meta.update(parts=self.parts, numel=self.numel)
        return meta

    @classmethod
    def from_meta(cls, meta: object) -> StateReply:
        f = Fields("STATE", meta)
        op, round_id = f.choice("op", StateOp, None), f.integer("round", None)
        if round_id is None or op == StateOp.STORED:
            return cls(op, round_id)
        parts = f.integer("parts", 1)
        if parts not in STATE_PARTS:
            raise f.error("parts", f"one of {STATE_PARTS}")
        return cls(op, round_id, parts, f.integer("numel", low=0))
