"""The soft-label service's messages, typed: who connects to a label relay (``LabelHello``)
and what it answers (``LabelWelcome``, or ``LabelRefusal``), an ask for soft labels
(``LabelAsk``, token ids in its payload), its answer (``LabelAnswer``, sparse labels in its
payload, `sparse`) or why it gets none (``LabelFailed``).

Protocol 3: a server's HELLO says its model's vocabulary and context, a student's its rank;
the WELCOME says the teacher's vocabulary and context and how many asks a link may have
outstanding, so that a student asks nothing the teacher cannot run.

Each is declared once, a frozen keyword-only dataclass whose fields are its encoding and its
strict decoder (:mod:`nebula_cli.relay.net.schema`), called where its frame is received. Every
size is
bounded: an ask carries at most ``max_tokens`` tokens (the label relay's, said in its
WELCOME), its payload exactly ``(tokens * bits + 7) // 8`` bytes: the token ids in ``bits``
bits each (1..24, the bit length of the largest id asked), packed as an answer's ids are
(`idpack`; protocol 2, where protocol 1 sent 4-byte ids); an answer's payload is exactly what
its rows, k, vocabulary and encoding make.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from nebula_cli.relay.distill.idpack import MAX_ID_BITS, packed_nbytes, unpack_ids
from nebula_cli.relay.distill.sparse import MAX_VOCAB, Values
from nebula_cli.relay.net.schema import MessageError, decode, encode, wire
from nebula_cli.relay.net.wire import Frame, FrameType

PROTOCOL = 3
"""The soft-label service's version (a HELLO of another is refused); 2: asks pack their ids;
3: the teacher's vocabulary and context in WELCOME, a student's rank in HELLO, LABELS_FAILED."""
MAX_TOPK = 1024
MAX_SEQ = (1 << 62)
MAX_RANK = 1 << 20
MAX_REASON = 512
"""Characters of a refusal's or a failure's reason kept."""


class Side(StrEnum):
    """Who connects to a label relay."""

    STUDENT = "student"
    """A training cluster's rank: asks for soft labels."""
    SERVER = "server"
    """A teacher's serving rank (its own cluster's): answers them."""


@dataclass(frozen=True, kw_only=True)
class LabelHello:
    """The first frame on a label relay's connection."""

    NAME: ClassVar[str] = "label HELLO"

    job: str = wire(max_chars=128)
    side: Side
    protocol: int = wire(PROTOCOL, required=True, low=1)
    rank: int = wire(0, low=0, high=MAX_RANK, omit_default=True)
    """A student: its rank in its cluster (a rank's new link replaces its older one)."""
    vocab: int = wire(0, low=0, high=MAX_VOCAB, omit_default=True)
    """A server: its model's vocabulary (0: a student's HELLO)."""
    context: int = wire(0, low=0, omit_default=True)
    """A server: the most positions its model runs (0: a student's HELLO)."""

    def to_frame(self) -> Frame:
        return Frame(FrameType.HELLO, encode(self))


@dataclass(frozen=True, kw_only=True)
class LabelWelcome:
    """The label relay's answer: its teacher cluster and the job's settings for soft labels."""

    NAME: ClassVar[str] = "label WELCOME"

    cluster: str = wire(max_chars=64)
    topk: int = wire(low=1, high=MAX_TOPK)
    values: Values
    max_tokens: int = wire(low=1)
    vocab: int = wire(low=2, high=MAX_VOCAB)
    """The teacher's vocabulary: an ask with an id at or beyond it is refused."""
    context: int = wire(low=1)
    """The teacher's context: an ask of sequences wider is refused."""
    max_asks: int = wire(low=1)
    """Asks a link may have outstanding (unanswered); one more ends the link."""

    def to_frame(self) -> Frame:
        return Frame(FrameType.WELCOME, encode(self))


@dataclass(frozen=True, kw_only=True)
class LabelRefusal:
    """A label relay's answer to a HELLO it refuses (or its last frame on a link it ends)."""

    NAME: ClassVar[str] = "label ERROR"

    reason: str = wire(max_chars=MAX_REASON)

    def to_frame(self) -> Frame:
        return Frame(FrameType.ERROR, encode(self))


@dataclass(frozen=True, kw_only=True)
class LabelFailed:
    """Ask ``seq`` gets no labels, and why (the teacher could not run it, or it was refused
    before it was queued): its asker trains that batch without them or stops, as it is told."""

    NAME: ClassVar[str] = "LABELS_FAILED"

    seq: int = wire(low=0, high=MAX_SEQ)
    reason: str = wire(max_chars=MAX_REASON)
    teacher: str = wire("", max_chars=64)

    def to_frame(self) -> Frame:
        return Frame(FrameType.LABELS_FAILED, encode(self))


@dataclass(frozen=True, kw_only=True)
class LabelAsk:
    """Soft labels asked for ``tokens`` token ids (the payload: ``tokens`` ids of ``bits``
    bits each, packed (`idpack`), sequences of ``width`` tokens one after the other); ``seq``
    names the ask to its asker (on a server's link: the relay's own number)."""

    NAME: ClassVar[str] = "LABELS_ASK"

    seq: int = wire(low=0, high=MAX_SEQ)
    tokens: int = wire(low=1, high="max_tokens")
    width: int = wire(low=1, high="max_tokens")
    bits: int = wire(low=1, high=MAX_ID_BITS)

    @property
    def payload_nbytes(self) -> int:
        """The exact length of the ask's payload."""
        return packed_nbytes(self.tokens, self.bits)

    def to_frame(self, payload: bytes | bytearray | memoryview) -> Frame:
        return Frame(FrameType.LABELS_ASK, encode(self), payload)

    @classmethod
    def from_frame(cls, frame: Frame, max_tokens: int) -> LabelAsk:
        """The ask a frame carries, its payload checked against it (``max_tokens``: the label
        relay's)."""
        ask = decode(cls, frame.meta, limits={"max_tokens": max_tokens})
        if ask.tokens % ask.width:
            raise MessageError(f"LABELS_ASK: {ask.tokens} tokens are not sequences of "
                               f"{ask.width}")
        if len(frame.payload) != ask.payload_nbytes:
            raise MessageError(f"LABELS_ASK: {ask.tokens} tokens of {ask.bits} bits in "
                               f"{len(frame.payload)} bytes; expected {ask.payload_nbytes}")
        return ask

    def beyond(self, payload: bytes | bytearray | memoryview, vocab: int, context: int
               ) -> str | None:
        """Why a teacher of vocabulary ``vocab`` and context ``context`` cannot run this ask
        (an id at or beyond its vocabulary, sequences wider than its context), or None."""
        if self.width > context:
            return (f"sequences of {self.width} tokens; the teacher's context is {context} "
                    "positions")
        if (1 << self.bits) <= vocab:
            return None  # every id of these bits fits
        top = int(unpack_ids(payload, self.tokens, self.bits).max())
        if top >= vocab:
            return (f"token id {top}; the teacher's vocabulary is {vocab} tokens (ids 0.."
                    f"{vocab - 1}): the student's tokenizer is not the teacher's")
        return None


@dataclass(frozen=True, kw_only=True)
class LabelAnswer:
    """A teacher's answer to ask ``seq``: ``rows`` tokens' top ``k`` labels over a vocabulary
    of ``vocab`` (the payload: `sparse`), from cluster ``teacher`` (read with the label
    relay's ``max_tokens`` as a limit: ``decode(LabelAnswer, meta, limits=...)``)."""

    NAME: ClassVar[str] = "LABELS"

    seq: int = wire(low=0, high=MAX_SEQ)
    rows: int = wire(low=1, high="max_tokens")
    k: int = wire(low=1, high=MAX_TOPK)
    vocab: int = wire(low=2, high=MAX_VOCAB)
    values: Values
    teacher: str = wire("", max_chars=64)

    def to_frame(self, payload: bytes | bytearray | memoryview) -> Frame:
        return Frame(FrameType.LABELS, encode(self), payload)


def max_ask_bytes(max_tokens: int) -> int:
    """The largest ask payload a link may receive (``max_tokens`` ids of 24 bits)."""
    return packed_nbytes(max_tokens, MAX_ID_BITS)


def max_answer_bytes(max_tokens: int, topk: int) -> int:
    """The largest answer payload a link may receive (24-bit ids and fp16 values)."""
    return max_tokens * topk * 5 + 8
