"""The soft-label service's messages, typed: who connects to a label relay (``LabelHello``)
and what it answers (``LabelWelcome``), an ask for soft labels (``LabelAsk``, token ids in its
payload) and its answer (``LabelAnswer``, sparse labels in its payload, `sparse`).

Each is a frozen dataclass with ``to_frame`` and one strict ``from_meta``
(:mod:`nebula_cli.relay.net.schema`), called where its frame is received. Every size is
bounded: an ask carries at most ``max_tokens`` tokens (the label relay's, said in its
WELCOME), its payload exactly ``(tokens * bits + 7) // 8`` bytes: the token ids in ``bits``
bits each (1..24, the bit length of the largest id asked), packed as an answer's ids are
(`idpack`; protocol 2, where protocol 1 sent 4-byte ids); an answer's payload is exactly what
its rows, k, vocabulary and encoding make.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from nebula_cli.relay.distill.idpack import MAX_ID_BITS, packed_nbytes
from nebula_cli.relay.distill.sparse import MAX_VOCAB, Values
from nebula_cli.relay.net.schema import Fields, MessageError
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


@dataclass(frozen=True)
class LabelHello:
    """The first frame on a label relay's connection."""

    job: str
    side: Side
    protocol: int = PROTOCOL

    def to_frame(self) -> Frame:
        return Frame(FrameType.HELLO, {"job": self.job, "side": self.side.value,
                                       "protocol": self.protocol})

    @classmethod
    def from_meta(cls, meta: object) -> LabelHello:
        f = Fields("label HELLO", meta)
        return cls(f.text("job", max_chars=128), f.choice("side", Side),
                   f.integer("protocol", low=1))


@dataclass(frozen=True)
class LabelWelcome:
    """The label relay's answer: its teacher cluster and the job's settings for soft labels."""

    cluster: str
    topk: int
    values: Values
    max_tokens: int

    def to_frame(self) -> Frame:
        return Frame(FrameType.WELCOME, {"cluster": self.cluster, "topk": self.topk,
                                         "values": self.values.value,
                                         "max_tokens": self.max_tokens})

    @classmethod
    def from_meta(cls, meta: object) -> LabelWelcome:
        f = Fields("label WELCOME", meta)
        return cls(f.text("cluster", max_chars=64), f.integer("topk", low=1, high=MAX_TOPK),
                   f.choice("values", Values), f.integer("max_tokens", low=1))


@dataclass(frozen=True)
class LabelAsk:
    """Soft labels asked for ``tokens`` token ids (the payload: ``tokens`` ids of ``bits``
    bits each, packed (`idpack`), sequences of ``width`` tokens one after the other); ``seq``
    names the ask to its asker (on a server's link: the relay's own number)."""

    seq: int
    tokens: int
    width: int
    bits: int

    @property
    def payload_nbytes(self) -> int:
        """The exact length of the ask's payload."""
        return packed_nbytes(self.tokens, self.bits)

    def to_frame(self, payload: bytes | bytearray | memoryview) -> Frame:
        return Frame(FrameType.LABELS_ASK, {"seq": self.seq, "tokens": self.tokens,
                                            "width": self.width, "bits": self.bits}, payload)

    @classmethod
    def from_frame(cls, frame: Frame, max_tokens: int) -> LabelAsk:
        f = Fields("LABELS_ASK", frame.meta)
        ask = cls(f.integer("seq", low=0, high=MAX_SEQ),
                  f.integer("tokens", low=1, high=max_tokens),
                  f.integer("width", low=1, high=max_tokens),
                  f.integer("bits", low=1, high=MAX_ID_BITS))
        if ask.tokens % ask.width:
            raise MessageError(f"LABELS_ASK: {ask.tokens} tokens are not sequences of "
                               f"{ask.width}")
        if len(frame.payload) != ask.payload_nbytes:
            raise MessageError(f"LABELS_ASK: {ask.tokens} tokens of {ask.bits} bits in "
                               f"{len(frame.payload)} bytes; expected {ask.payload_nbytes}")
        return ask


@dataclass(frozen=True)
class LabelAnswer:
    """A teacher's answer to ask ``seq``: ``rows`` tokens' top ``k`` labels over a vocabulary
    of ``vocab`` (the payload: `sparse`), from cluster ``teacher``."""

    seq: int
    rows: int
    k: int
    vocab: int
    values: Values
    teacher: str

    def to_frame(self, payload: bytes | bytearray | memoryview) -> Frame:
        return Frame(FrameType.LABELS, self.to_meta(), payload)

    def to_meta(self) -> dict[str, Any]:
        return {"seq": self.seq, "rows": self.rows, "k": self.k, "vocab": self.vocab,
                "values": self.values.value, "teacher": self.teacher}

    @classmethod
    def from_meta(cls, meta: object, max_tokens: int) -> LabelAnswer:
        f = Fields("LABELS", meta)
        return cls(f.integer("seq", low=0, high=MAX_SEQ),
                   f.integer("rows", low=1, high=max_tokens),
                   f.integer("k", low=1, high=MAX_TOPK), f.integer("vocab", low=2, high=MAX_VOCAB),
                   f.choice("values", Values), f.text("teacher", "", max_chars=64))


def max_ask_bytes(max_tokens: int) -> int:
    """The largest ask payload a link may receive (``max_tokens`` ids of 24 bits)."""
    return packed_nbytes(max_tokens, MAX_ID_BITS)


def max_answer_bytes(max_tokens: int, topk: int) -> int:
    """The largest answer payload a link may receive (24-bit ids and fp16 values)."""
    return max_tokens * topk * 5 + 8
