"""The soft-label service's messages (`relay.distill.messages`): an ask's token ids take the bits
its largest id needs (11 at a vocabulary of 2048, against 32 in protocol 1), an ask of
another length, or of a width outside 1..24, is refused, and one beyond a teacher's vocabulary
or context says which."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.wire_pins import pinned

from nebula_cli.relay.distill.idpack import pack_ids, unpack_ids
from nebula_cli.relay.distill.messages import (
    PROTOCOL,
    LabelAnswer,
    LabelAsk,
    LabelFailed,
    LabelHello,
    LabelRefusal,
    LabelWelcome,
    Side,
    max_ask_bytes,
)
from nebula_cli.relay.distill.sparse import Values
from nebula_cli.relay.net.schema import MessageError
from nebula_cli.relay.net.wire import Frame, FrameType

V = 2048


@pytest.mark.parametrize("n", [1, 7, 8, 64, 1000])
def test_an_ask_at_a_vocabulary_of_2048_takes_11_bits_a_token(n: int) -> None:
    ids = np.random.default_rng(n).integers(0, V, size=n)
    ids[-1] = V - 1
    ask = LabelAsk(seq=3, tokens=n, width=1, bits=11)
    frame = ask.to_frame(pack_ids(ids, ask.bits))
    assert len(frame.payload) == ask.payload_nbytes == (n * 11 + 7) // 8
    got = LabelAsk.from_frame(frame, max_tokens=1024)
    assert got == ask
    assert np.array_equal(unpack_ids(frame.payload, got.tokens, got.bits), ids)
    if n == 1000:  # 1.375 bytes a token where protocol 1 sent 4
        assert len(frame.payload) / n == 1.375


def test_an_ask_of_another_length_or_width_is_refused() -> None:
    payload = pack_ids(np.arange(8), 11)
    with pytest.raises(MessageError, match=r"8 tokens of 11 bits in 32 bytes; expected 11"):
        LabelAsk.from_frame(LabelAsk(seq=0, tokens=8, width=8, bits=11).to_frame(bytes(8 * 4)), 16)
    with pytest.raises(MessageError, match="expected 11"):
        LabelAsk.from_frame(LabelAsk(seq=0, tokens=8, width=8, bits=11).to_frame(payload[:-1]), 16)
    with pytest.raises(MessageError, match="expected 11"):
        LabelAsk.from_frame(LabelAsk(seq=0, tokens=8, width=8, bits=11).to_frame(payload + b"\0"),
                            16)
    for bits in (0, 25):
        with pytest.raises(MessageError, match="bits"):
            LabelAsk.from_frame(LabelAsk(seq=0, tokens=8, width=8, bits=bits).to_frame(payload), 16)
    no_bits = Frame(FrameType.LABELS_ASK, {"seq": 0, "tokens": 8, "width": 8}, payload)
    with pytest.raises(MessageError, match="bits"):
        LabelAsk.from_frame(no_bits, 16)
    with pytest.raises(MessageError, match="tokens"):
        LabelAsk.from_frame(LabelAsk(seq=0, tokens=17, width=17,
                                     bits=11).to_frame(pack_ids(np.arange(17), 11)), 16)


def test_a_link_bounds_asks_by_24_bit_ids_and_speaks_protocol_3() -> None:
    assert max_ask_bytes(1024) == 1024 * 3 and max_ask_bytes(5) == 15
    assert PROTOCOL == 3 and LabelHello(job="j", side=Side.STUDENT).to_frame().meta["protocol"] == 3


@pytest.mark.parametrize("ids, width, says", [
    (np.array([5, 4999]), 2, None),
    (np.array([5, 5000]), 2, "token id 5000; the teacher's vocabulary is 5000 tokens"),
    (np.arange(8) % 3, 8, "sequences of 8 tokens; the teacher's context is 4 positions"),
])
def test_an_ask_beyond_the_teachers_vocabulary_or_context_says_which(
        ids: np.ndarray, width: int, says: str | None) -> None:
    bits = max(1, int(ids.max()).bit_length())
    ask = LabelAsk(seq=0, tokens=len(ids), width=width, bits=bits)
    got = ask.beyond(pack_ids(ids, bits), vocab=5000, context=4)
    assert got == says if says is None else says in got

# The bytes of each message, pinned before the messages were declared once (relay/net/schema.py
# derives every encoding from the fields): they must not move. Protocol 3 (issue 48) added a
# student's rank and a server's vocabulary and context to HELLO (absent when 0), the teacher's
# vocabulary, context and asks a link may hold to WELCOME, a refusal and LABELS_FAILED.
PINS = [
    (lambda: LabelHello(job='j', side=Side.STUDENT).to_frame(),
     'HELLO {"job":"j","side":"student","protocol":3}'),
    (lambda: LabelHello(job='j', side=Side.STUDENT, rank=3).to_frame(),
     'HELLO {"job":"j","side":"student","protocol":3,"rank":3}'),
    (lambda: LabelHello(job='j', side=Side.SERVER, vocab=50257, context=1024).to_frame(),
     'HELLO {"job":"j","side":"server","protocol":3,"vocab":50257,"context":1024}'),
    (lambda: LabelHello(job='job-1', side=Side.SERVER, protocol=1).to_frame(),
     'HELLO {"job":"job-1","side":"server","protocol":1}'),
    (lambda: LabelWelcome(cluster='t', topk=32, values=Values.INT8, max_tokens=4096, vocab=2048,
                          context=1024, max_asks=10).to_frame(),
     'WELCOME {"cluster":"t","topk":32,"values":"int8","max_tokens":4096,"vocab":2048,'
     '"context":1024,"max_asks":10}'),
    (lambda: LabelRefusal(reason='no').to_frame(), 'ERROR {"reason":"no"}'),
    (lambda: LabelFailed(seq=3, reason='too wide', teacher='t').to_frame(),
     'LABELS_FAILED {"seq":3,"reason":"too wide","teacher":"t"}'),
    (lambda: LabelAsk(seq=3, tokens=16, width=8, bits=11).to_frame(b''),
     'LABELS_ASK {"seq":3,"tokens":16,"width":8,"bits":11}'),
    (lambda: LabelAnswer(seq=3, rows=16, k=8, vocab=2048, values=Values.FP16,
             teacher='t').to_frame(b''),
     'LABELS {"seq":3,"rows":16,"k":8,"vocab":2048,"values":"fp16","teacher":"t"}'),
]


@pytest.mark.parametrize("make, wire", PINS)
def test_each_message_encodes_to_protocol_2s_bytes(make, wire: str) -> None:
    assert pinned(make()) == wire

