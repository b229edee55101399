"""The soft-label service's messages, typed: who connects to a label relay (``LabelHello``)
and what it answers (``LabelWelcome``), an ask for soft labels (``LabelAsk``, token ids in its
payload) and its answer (``LabelAnswer``, sparse labels in its payload, `sparse`).

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

from nebula_cli.relay.distill.idpack import MAX_ID_BITS, packed_nbytes
from nebula_cli.relay.distill.sparse import MAX_VOCAB, Values
from nebula_cli.relay.net.schema import MessageError, decode, encode, wire
from nebula_cli.relay.net.wire import Frame, FrameType

PROTOCOL = 2
"""The soft-label service's version (a HELLO of another is refused); 2: asks pack their ids."""
MAX_TOPK = 1024
MAX_SEQ = (1 << 62)


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

    def to_frame(self) -> Frame:
        return Frame(FrameType.WELCOME, encode(self))


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
