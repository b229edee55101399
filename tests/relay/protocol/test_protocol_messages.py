"""relay/protocol/messages.py: round control, chunks and fetches between relays, typed. Each
message goes through real frame bytes (encode_frame / recv_frame) and back equal; what does
not fit is refused with its field named; the JSON keys are protocol 2's."""

from __future__ import annotations

import socket

import pytest
import torch
from helpers.wire_pins import pinned

from nebula_cli.relay.codecs.registry import get_codec
from nebula_cli.relay.net.limits import held_size
from nebula_cli.relay.net.schema import MessageError, encode
from nebula_cli.relay.net.wire import Frame, FrameType, recv_frame, send_frame
from nebula_cli.relay.protocol.agreement import Decision
from nebula_cli.relay.protocol.lineage import UNKNOWN
from nebula_cli.relay.protocol.messages import (
    MAX_ATTEMPTS,
    Abort,
    AnswerChunk,
    AnswerStatus,
    Behind,
    ChunkKind,
    Fetched,
    PeerChunk,
    Ready,
    ResultAnswer,
    ResultAsk,
    StateAnswer,
    StateAsk,
    decode_answer,
    decode_fetch,
    decode_round,
    round_frame,
)
from nebula_cli.relay.protocol.next_round import NextRound
from nebula_cli.relay.protocol.pacing import RoundInfo


def over_the_wire(frame: Frame) -> Frame:
    """``frame`` as the other end of a connection reads it."""
    a, b = socket.socketpair()
    try:
        send_frame(a, frame)
        return recv_frame(b, max_payload=1 << 24)
    finally:
        a.close()
        b.close()


def test_round_control_round_trips_with_protocol_2_keys() -> None:
    ready = Ready(round=4, attempt=1, ok=True, numel=1000, reason="", lineage="abc",
                  info=RoundInfo(weight=64.0, step_s=0.1), codec="int8", codec_round=3)
    decision = Decision(round=4, attempt=1, coordinator="a", present=("a", "b"), rejected=("c",),
                        missing=(), numel=1000, diverged=(), weights=(("a", 2.0), ("b", 1.0)),
                        codec="int8", next=NextRound(h=9, merge=2, codec="topk", why="w"))
    for msg, keys in ((ready, {"op", "round", "attempt", "ok", "numel", "reason", "lineage",
                               "info", "codec", "codec_round"}),
                      (decision, {"op", "round", "attempt", "coord", "present", "rejected",
                                  "missing", "numel", "diverged", "weights", "next_h", "why",
                                  "codec", "next_codec", "next_merge"}),
                      (Behind(round=7), {"op", "round"}),
                      (Abort(round=4, attempt=1, coord="a", reason="lost b"), {"op", "round",
                                                                               "attempt", "coord",
                                                                               "reason"})):
        frame = over_the_wire(round_frame(msg))
        assert frame.type == FrameType.ROUND and set(frame.meta) == keys
        assert decode_round(frame.meta) == msg


def test_a_ready_from_before_info_and_codecs_gets_defaults() -> None:
    got = decode_round({"op": "ready", "round": 0, "attempt": 0, "ok": False, "numel": 4})
    assert got == Ready(round=0, attempt=0, ok=False, numel=4, reason="", lineage=UNKNOWN,
                        info=RoundInfo(), codec="", codec_round=-1)


@pytest.mark.parametrize("meta, words", [
    ({"op": "go", "round": 0}, "op must be one of"),
    ({"round": 0}, "op is missing"),
    ({"op": "ready", "round": 0, "attempt": MAX_ATTEMPTS, "ok": True, "numel": 4}, "attempt"),
    ({"op": "ready", "round": 0, "attempt": 0, "ok": 1, "numel": 4}, "ok must be true or false"),
    ({"op": "ready", "round": "0", "attempt": 0, "ok": True, "numel": 4}, "round must be"),
    ({"op": "ready", "round": 0, "attempt": 0, "ok": True, "numel": -4}, "numel must be"),
    ({"op": "behind", "round": True}, "round must be an integer"),
    ({"op": "abort", "round": 0, "attempt": 0}, "coord is missing"),
    ({"op": "start", "round": 0, "attempt": 0, "coord": "a", "present": ["a"], "rejected": [],
      "missing": [], "numel": 4, "weights": {"b": 1.0}}, "weights"),
])
def test_malformed_round_control_is_refused_naming_the_field(meta: dict, words: str) -> None:
    with pytest.raises(MessageError, match=words):
        decode_round(meta)


def test_chunks_round_trip_with_their_encoding_or_as_zeros() -> None:
    codec = get_codec("int8", block_size=64)
    enc = codec.encode(torch.randn(256))
    for chunk in (PeerChunk(kind=ChunkKind.CONTRIB, round=3, attempt=0, coord="a", k=2, enc=enc),
                  PeerChunk(kind=ChunkKind.AVG, round=3, attempt=1, coord="b", k=0, enc=None)):
        got = PeerChunk.from_frame(over_the_wire(chunk.to_frame()))
        assert (got.kind, got.key, got.k) == (chunk.kind, chunk.key, chunk.k)
        if chunk.enc is None:
            assert got.enc is None
        else:
            assert got.enc is not None and bytes(got.enc.payload) == bytes(enc.payload)
            assert torch.equal(codec.decode(got.enc), codec.decode(enc))
        assert got.held_size() == held_size(chunk.to_frame())  # counted as its frame


@pytest.mark.parametrize("change, words", [
    ({"op": "sum"}, "op must be one of"), ({"k": -1}, "k must be an integer >= 0"),
    ({"coord": None}, "coord is missing"), ({"codec": 5}, "'codec' must be a string"),
    ({"zero": "yes"}, "zero must be true or false"),
])
def test_malformed_chunks_are_refused(change: dict, words: str) -> None:
    meta = {"op": "contrib", "round": 1, "attempt": 0, "coord": "a", "k": 0, "codec": "none",
            "numel": 1, "codec_meta": {}, **change}
    with pytest.raises(MessageError, match=words):
        PeerChunk.from_frame(Frame(FrameType.PEER_CHUNK, meta, bytes(4)))


def test_fetch_requests_say_what_they_want() -> None:
    result = ResultAsk(round=5, wait=2.0, req=9)
    state = StateAsk(min_round=5, wait=0.0, req=10)
    assert encode(result) == {"op": "result", "round": 5, "wait": 2.0, "req": 9}
    assert encode(state) == {"op": "state", "min_round": 5, "wait": 0.0, "req": 10}
    assert "wait" not in encode(ResultAsk(round=5, req=1))
    for ask in (result, state, ResultAsk(round=5, req=1)):
        assert decode_fetch(over_the_wire(
            Frame(FrameType.STATE_REQUEST, encode(ask))).meta) == ask
    assert (result.what, state.what) == (Fetched.RESULT, Fetched.STATE)
    with pytest.raises(MessageError, match="op must be one of"):
        decode_fetch({"op": "everything", "req": 1})
    with pytest.raises(MessageError, match="wait must be a number >= 0"):
        decode_fetch({"op": "state", "min_round": 1, "wait": -1, "req": 1})


def test_answers_are_a_header_then_chunks() -> None:
    ok = ResultAnswer(req=3, status=AnswerStatus.OK, round=7, present=("a", "b"), rejected=("c",),
                      codec="int8", numel=100)
    st = StateAnswer(req=4, status=AnswerStatus.OK, round=7, lineage="lin", parts=2, numel=200)
    busy = StateAnswer(req=5, status=AnswerStatus.BUSY)
    assert decode_answer(Frame(FrameType.RESULT, encode(ok))) == ok
    assert decode_answer(Frame(FrameType.STATE, encode(st))) == st
    assert decode_answer(Frame(FrameType.STATE, encode(busy))) == busy
    assert encode(busy) == {"req": 5, "status": "busy"}
    chunk = decode_answer(Frame(FrameType.RESULT, {"req": 3, "lo": 64}, bytes(8)))
    assert isinstance(chunk, AnswerChunk) and (chunk.req, chunk.lo) == (3, 64)
    with pytest.raises(MessageError, match="parts must be one of"):
        decode_answer(Frame(FrameType.STATE, {**encode(st), "parts": 3}))
    with pytest.raises(MessageError, match="numel is missing"):
        decode_answer(Frame(FrameType.RESULT, {"req": 1, "status": "ok", "round": 1}))
    with pytest.raises(MessageError, match="lo must be"):
        decode_answer(Frame(FrameType.RESULT, {"req": 3, "lo": "0"}, bytes(8)))

# Protocol 2's bytes of each message, pinned before the messages were declared once
# (relay/net/schema.py derives every encoding from the fields): they must not move.
PINS = [
    (lambda: round_frame(Ready(round=4, attempt=1, ok=True, numel=1000, reason='', lineage='abc',
             info=RoundInfo(weight=64.0, step_s=0.1), codec='int8', codec_round=3)),
     'ROUND {"op":"ready","round":4,"attempt":1,"ok":true,"numel":1000,"reason":"","lineage":"abc'
     '","info":{"weight":64.0,"step_s":0.1},"codec":"int8","codec_round":3}'),
    (lambda: round_frame(Ready(round=0, attempt=0, ok=False, numel=4, reason='bad')),
     'ROUND {"op":"ready","round":0,"attempt":0,"ok":false,"numel":4,"reason":"bad","lineage":"un'
     'known","info":{},"codec":"","codec_round":-1}'),
    (lambda: round_frame(Decision(round=4, attempt=1, coordinator='a', present=('a', 'b'),
             rejected=('c',), missing=(), numel=1000, diverged=('d',), weights=(('a', 2.0), ('b',
             1.0)), codec='int8', next=NextRound(h=9, merge=2, codec='topk', why='w'))),
     'ROUND {"op":"start","round":4,"attempt":1,"coord":"a","present":["a","b"],"rejected":["c"],'
     '"missing":[],"numel":1000,"diverged":["d"],"weights":{"a":2.0,"b":1.0},"codec":"int8","next'
     '_h":9,"next_merge":2,"next_codec":"topk","why":"w"}'),
    (lambda: round_frame(Decision(round=0, attempt=0, coordinator='b', present=('b',), rejected=(),
             missing=('a',), numel=8)),
     'ROUND {"op":"start","round":0,"attempt":0,"coord":"b","present":["b"],"rejected":[],"missin'
     'g":["a"],"numel":8,"diverged":[],"weights":{},"codec":"","next_h":null,"next_merge":null,"n'
     'ext_codec":"","why":""}'),
    (lambda: round_frame(Behind(round=7)),
     'ROUND {"op":"behind","round":7}'),
    (lambda: round_frame(Abort(round=4, attempt=1, coord='a', reason='lost b')),
     'ROUND {"op":"abort","round":4,"attempt":1,"coord":"a","reason":"lost b"}'),
    (lambda: round_frame(Abort(round=4, attempt=0, coord='a')),
     'ROUND {"op":"abort","round":4,"attempt":0,"coord":"a","reason":""}'),
    (lambda: PeerChunk(kind=ChunkKind.CONTRIB, round=3, attempt=0, coord='a', k=2,
             enc=get_codec('int8', block_size=64).encode(torch.arange(128,
             dtype=torch.float32))).to_frame(),
     'PEER_CHUNK {"op":"contrib","round":3,"attempt":0,"coord":"a","k":2,"codec":"int8","numel":1'
     '28,"codec_meta":{"block_size":64}}'),
    (lambda: PeerChunk(kind=ChunkKind.AVG, round=3, attempt=1, coord='b', k=0,
             enc=None).to_frame(),
     'PEER_CHUNK {"op":"avg","round":3,"attempt":1,"coord":"b","k":0,"zero":true}'),
    (lambda: ResultAsk(round=5, wait=2.0, req=9),
     '{"op":"result","round":5,"wait":2.0,"req":9}'),
    (lambda: StateAsk(min_round=5, wait=0.0, req=10),
     '{"op":"state","min_round":5,"wait":0.0,"req":10}'),
    (lambda: ResultAsk(round=5, req=1),
     '{"op":"result","round":5,"req":1}'),
    (lambda: StateAsk(min_round=-1),
     '{"op":"state","min_round":-1,"req":0}'),
    (lambda: ResultAnswer(req=3, status=AnswerStatus.OK, round=7, present=('a', 'b'),
             rejected=('c',), codec='int8', numel=100),
     '{"req":3,"status":"ok","round":7,"present":["a","b"],"rejected":["c"],"codec":"int8","numel'
     '":100}'),
    (lambda: ResultAnswer(req=3, status=AnswerStatus.NONE),
     '{"req":3,"status":"none"}'),
    (lambda: StateAnswer(req=4, status=AnswerStatus.OK, round=7, lineage='lin', parts=2,
             numel=200),
     '{"req":4,"status":"ok","round":7,"lineage":"lin","parts":2,"numel":200}'),
    (lambda: StateAnswer(req=5, status=AnswerStatus.BUSY),
     '{"req":5,"status":"busy"}'),
    (lambda: RoundInfo(),
     ""),
    (lambda: RoundInfo(weight=64.0, step_s=0.1, comm_s=0.0, codec='int8', arrive_s=1.5),
     '{"weight":64.0,"step_s":0.1,"comm_s":0.0,"codec":"int8","arrive_s":1.5}'),
    (lambda: RoundInfo(comm_s=2.0),
     '{"comm_s":2.0}'),
]


@pytest.mark.parametrize("make, wire", PINS)
def test_each_message_encodes_to_protocol_2s_bytes(make, wire: str) -> None:
    assert pinned(make()) == wire

