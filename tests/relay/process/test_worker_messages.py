"""relay/process/worker_messages.py: the worker hop's requests and answers, typed (the real hop,
client to relay, is exercised by tests/relay/process/test_server.py and
tests/relay/net/test_local_socket.py)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.wire_pins import pinned

from nebula_cli.relay.net.limits import SyncSize
from nebula_cli.relay.net.messages import RelayProgress
from nebula_cli.relay.net.schema import MessageError, decode, encode
from nebula_cli.relay.net.wire import Frame, FrameType
from nebula_cli.relay.process.worker_messages import (
    Bye,
    Contrib,
    FetchState,
    FinalState,
    Publish,
    RoundReply,
    StateOp,
    StateReply,
    WorkerHello,
    WorkerWelcome,
    decode_request,
)
from nebula_cli.relay.protocol.next_round import NextRound
from nebula_cli.relay.protocol.pacing import RoundInfo
from nebula_cli.relay.protocol.results import RoundMode, RoundOutcome


def wire(meta: dict) -> dict:
    return json.loads(json.dumps(meta))


def test_every_request_is_decoded_as_sent() -> None:
    layout = SyncSize(((2, 3), (4,)), ("float32", "bfloat16"))
    hello = WorkerHello(cluster="a", job_id="job", layout=layout)
    contrib = Contrib(round=3, numel=10, info=RoundInfo(weight=32.0, step_s=0.2), released=(4, 5))
    publish = Publish(round=3, numel=20, parts=2)
    for req, ftype in ((hello, FrameType.HELLO), (contrib, FrameType.CONTRIB),
                       (publish, FrameType.STATE)):
        frame = req.to_frame() if isinstance(req, WorkerHello) else Frame(ftype, encode(req))
        assert decode_request(Frame(frame.type, wire(frame.meta))) == req
    assert decode_request(FetchState().to_frame()) == FetchState()
    assert decode_request(FinalState(wait=2.5).to_frame()) == FinalState(wait=2.5)
    assert decode_request(FinalState().to_frame()) == FinalState(wait=None)
    assert decode_request(Frame(FrameType.BYE)) == Bye()
    assert decode_request(Frame(FrameType.HELLO, {"role": "worker"})) == WorkerHello()
    assert set(encode(Contrib(round=0, numel=4))) == {"op", "round", "numel", "released"}  # no info


@pytest.mark.parametrize("frame, words", [
    (Frame(FrameType.CONTRIB, {"op": "allreduce", "round": -1, "numel": 4}), "round"),
    (Frame(FrameType.CONTRIB, {"op": "allreduce", "round": 0, "numel": 4, "released": [1.5]}),
     "released"),
    (Frame(FrameType.STATE, {"op": "publish", "round": 0, "numel": 12, "parts": 3}),
     "a tensor in 3 parts"),
    (Frame(FrameType.STATE, {"op": "publish", "round": 0, "numel": 12, "parts": True}),
     "a tensor in True parts"),
    (Frame(FrameType.STATE_REQUEST, {"op": "final", "wait": "soon"}), "wait must be a number"),
    (Frame(FrameType.STATE_REQUEST, {"op": "delete"}), "op must be one of"),
    (Frame(FrameType.RESULT, {}), "unexpected RESULT frame"),
    (Frame(FrameType.HELLO, {"layout": {"shapes": [[-1]], "dtypes": ["float32"]}}),
     "malformed sync size"),
])
def test_a_request_that_does_not_fit_is_refused_with_why(frame: Frame, words: str) -> None:
    with pytest.raises(MessageError, match=words):
        decode_request(frame)


def test_a_rounds_reply_carries_the_outcome_and_the_next_round_whole() -> None:
    nxt = NextRound(h=12, merge=3, codec="topk", why="because")
    out = RoundOutcome(torch.zeros(8), ["a", "b"], 5, ["c"], [], mode=RoundMode.SHARD,
                       weights={"a": 2.0, "b": 1.0}, codec="int8", next=nxt,
                       global_state=torch.ones(16))
    out.seconds, out.bytes_sent, out.bytes_received = 1.5, 100, 200
    reply = RoundReply.of(out, upload_s=0.25, shm=None)
    meta = wire(encode(reply))
    assert "shm" not in meta and meta["mode"] == "shard" and meta["next_h"] == 12
    assert decode(RoundReply, meta) == reply
    assert (reply.next, reply.has_state, reply.numel, reply.present) == (nxt, True, 8,
                                                                         ("a", "b"))
    assert decode(RoundReply, {**meta, "shm": 7}).shm == 7
    with pytest.raises(MessageError, match="mode must be one of"):
        decode(RoundReply, {**meta, "mode": "lucky"})
    with pytest.raises(MessageError, match="next_merge"):
        decode(RoundReply, {**meta, "next_merge": -1})


def test_state_replies_say_whether_a_state_follows() -> None:
    for reply in (StateReply(op=StateOp.STORED, round=3), StateReply(op=StateOp.STATE, round=None),
                  StateReply(op=StateOp.FINAL, round=4, parts=2, numel=20), StateReply(op=None,
                                                                                       round=4,
                                                                                       parts=1,
                                                                                       numel=10)):
        assert decode(StateReply, wire(encode(reply))) == reply
    assert encode(StateReply(op=StateOp.STATE, round=None)) == {"op": "state", "round": None}
    with pytest.raises(MessageError, match="numel is missing"):
        decode(StateReply, {"op": "state", "round": 4})


def test_the_welcome_tells_who_the_relay_is_and_how_far() -> None:
    welcome = WorkerWelcome(cluster="a", clusters=("a", "b"), codec="auto", round_timeout=30.0,
                            progress=RelayProgress(done=4, lineage="x"))
    assert decode(WorkerWelcome, wire(encode(welcome))) == welcome

# Protocol 2's bytes of each message, pinned before the messages were declared once
# (relay/net/schema.py derives every encoding from the fields): they must not move.
PINS = [
    (lambda: WorkerHello(cluster='a', job_id='job', layout=SyncSize(((2, 3), (4,)), ('float32',
             'bfloat16'))).to_frame(),
     'HELLO {"role":"worker","cluster":"a","job_id":"job","layout":{"shapes":[[2,3],[4]],"dtypes"'
     ':["float32","bfloat16"]}}'),
    (lambda: WorkerHello().to_frame(),
     'HELLO {"role":"worker","cluster":null,"job_id":null}'),
    (lambda: Frame(FrameType.CONTRIB, encode(Contrib(round=3, numel=10, info=RoundInfo(weight=32.0,
             step_s=0.2), released=(4, 5)))),
     'CONTRIB {"op":"allreduce","round":3,"numel":10,"info":{"weight":32.0,"step_s":0.2},"release'
     'd":[4,5]}'),
    (lambda: Frame(FrameType.CONTRIB, encode(Contrib(round=0, numel=4))),
     'CONTRIB {"op":"allreduce","round":0,"numel":4,"released":[]}'),
    (lambda: Frame(FrameType.STATE, encode(Publish(round=3, numel=20, parts=2))),
     'STATE {"op":"publish","round":3,"parts":2,"numel":20}'),
    (lambda: Frame(FrameType.STATE, encode(Publish(round=3, numel=20))),
     'STATE {"op":"publish","round":3,"parts":1,"numel":20}'),
    (lambda: FetchState().to_frame(),
     'STATE_REQUEST {"op":"fetch"}'),
    (lambda: FinalState(wait=2.5).to_frame(),
     'STATE_REQUEST {"op":"final","wait":2.5}'),
    (lambda: FinalState().to_frame(),
     'STATE_REQUEST {"op":"final","wait":null}'),
    (lambda: WorkerWelcome(cluster='a', clusters=('a', 'b'), codec='auto', round_timeout=30.0,
             progress=RelayProgress(done=4, lineage='x')),
     '{"cluster":"a","clusters":["a","b"],"codec":"auto","round_timeout":30.0,"done":4,"state_rou'
     'nd":null,"result_round":null,"sync":null,"finished":null,"lineage":"x"}'),
    (lambda: RoundReply(round_id=5, present=('a', 'b'), rejected=('c',), missing=('d',),
             weights={'a': 2.0, 'b': 1.0}, codec='int8', next=NextRound(h=12, merge=3,
             codec='topk', why='because'), mode=RoundMode.SHARD, seconds=1.5, bytes_sent=100,
             bytes_received=200, upload_s=0.25, has_state=True, shm=None, numel=8),
     '{"round_id":5,"present":["a","b"],"next_h":12,"next_merge":3,"next_codec":"topk","why":"bec'
     'ause","codec":"int8","weights":{"a":2.0,"b":1.0},"rejected":["c"],"missing":["d"],"seconds"'
     ':1.5,"bytes_sent":100,"bytes_received":200,"upload_s":0.25,"has_state":true,"mode":"shard",'
     '"numel":8}'),
    (lambda: RoundReply(round_id=6, mode=RoundMode.ALONE, shm=7, numel=8),
     '{"round_id":6,"present":[],"next_h":null,"next_merge":null,"next_codec":"","why":"","codec"'
     ':"","weights":{},"rejected":[],"missing":[],"seconds":0.0,"bytes_sent":0,"bytes_received":0'
     ',"upload_s":0.0,"has_state":false,"mode":"alone","numel":8,"shm":7}'),
    (lambda: StateReply(op=StateOp.STORED, round=3),
     '{"op":"stored","round":3}'),
    (lambda: StateReply(op=StateOp.STATE, round=None),
     '{"op":"state","round":null}'),
    (lambda: StateReply(op=StateOp.FINAL, round=4, parts=2, numel=20),
     '{"op":"final","round":4,"parts":2,"numel":20}'),
    (lambda: StateReply(op=None, round=4, parts=1, numel=10),
     '{"round":4,"parts":1,"numel":10}'),
]


@pytest.mark.parametrize("make, wire", PINS)
def test_each_message_encodes_to_protocol_2s_bytes(make, wire: str) -> None:
    assert pinned(make()) == wire

