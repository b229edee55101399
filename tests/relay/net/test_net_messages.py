"""relay/net/messages.py: a peer link's own messages (progress, hello, ping, pong, refusal)."""

from __future__ import annotations

import json

import pytest
from helpers.wire_pins import pinned

from nebula_cli.relay.net.limits import SyncSize
from nebula_cli.relay.net.messages import (
    Goodbye,
    PeerHello,
    Ping,
    Pong,
    Refusal,
    RelayProgress,
    decode_heartbeat,
)
from nebula_cli.relay.net.schema import MessageError, decode, encode
from nebula_cli.relay.net.wire import FrameType


def test_progress_round_trips_and_states_the_sync_size_for_peers_to_see() -> None:
    p = RelayProgress(done=7, state_round=6, result_round=7, finished=None, lineage="abc",
                 sync=SyncSize.flat(100))
    meta = json.loads(json.dumps(encode(p)))
    assert set(meta) == {"done", "state_round", "result_round", "sync", "finished", "lineage"}
    assert meta["sync"]["numel"] == 100
    assert decode(RelayProgress, meta) == RelayProgress(done=7, state_round=6, result_round=7,
                                            finished=None, lineage="abc")  # a peer's: not read
    assert decode(RelayProgress, {}) == RelayProgress()  # nothing said: no round yet


@pytest.mark.parametrize("bad", [{"done": "3"}, {"done": -5}, {"finished": True},
                                 {"lineage": 5}, {"state_round": 1.5}])
def test_a_malformed_progress_is_refused(bad: dict) -> None:
    with pytest.raises(MessageError, match=next(iter(bad))):
        decode(RelayProgress, bad, what="HEARTBEAT")


def test_heartbeats_are_pings_pongs_or_progress() -> None:
    assert decode_heartbeat(Ping(id=4).to_frame().meta) == Ping(id=4)
    assert decode_heartbeat(Pong(id=4).to_frame().meta) == Pong(id=4)
    assert Ping(id=1).to_frame().type == FrameType.HEARTBEAT
    assert decode_heartbeat({"done": 3}) == RelayProgress(done=3)
    with pytest.raises(MessageError, match="op must be one of"):
        decode_heartbeat({"op": "pang", "id": 1})
    with pytest.raises(MessageError, match="id must be an integer"):
        decode_heartbeat({"op": "ping", "id": "x"})


def test_a_hello_names_its_cluster_and_carries_progress_and_an_offer() -> None:
    hello = decode(PeerHello, {"role": "relay", "cluster": "b", "job_id": "j", "done": 2,
                                 "records": {"cipher": "x"}})
    assert hello == PeerHello(cluster="b", progress=RelayProgress(done=2), records={"cipher": "x"})
    with pytest.raises(MessageError, match="HELLO: cluster is missing"):
        decode(PeerHello, {"done": 2})


def test_a_refusal_is_shown_whatever_it_says() -> None:
    assert Refusal.read(Refusal(reason="no").to_frame().meta) == Refusal(reason="no")
    assert Refusal(reason="no").to_frame().type == FrameType.ERROR
    assert Refusal.read({}).reason == ""
    assert Refusal.read({"reason": 42}).reason == "42"


def test_a_goodbye_says_whether_the_cluster_leaves_the_job() -> None:
    leaving = Goodbye(leaving=True).to_frame()
    assert leaving.type == FrameType.BYE and Goodbye.read(leaving.meta).leaving
    assert not Goodbye.read(Goodbye().to_frame().meta).leaving
    assert not Goodbye.read({}).leaving  # an older relay's goodbye: not leaving
    assert not Goodbye.read({"leaving": "yes"}).leaving  # malformed: not leaving

# Protocol 2's bytes of each message, pinned before the messages were declared once
# (relay/net/schema.py derives every encoding from the fields): they must not move.
PINS = [
    (lambda: RelayProgress(),
     '{"done":-1,"state_round":null,"result_round":null,"sync":null,"finished":null,"lineage":nul'
     'l}'),
    (lambda: RelayProgress(done=7, state_round=6, result_round=7, finished=None, lineage='abc',
             sync=SyncSize.flat(100)),
     '{"done":7,"state_round":6,"result_round":7,"sync":{"numel":100,"tensors":1,"dtypes":["float'
     '32"],"shapes_sha256":"2659a239ccad75d71ccea5625331b6ec5b64a7314d19262f5b24c6a6e51eebfc"},"f'
     'inished":null,"lineage":"abc"}'),
    (lambda: RelayProgress(done=3, state_round=None, result_round=2, finished=9, lineage=None),
     '{"done":3,"state_round":null,"result_round":2,"sync":null,"finished":9,"lineage":null}'),
    (lambda: Ping(id=4).to_frame(),
     'HEARTBEAT {"op":"ping","id":4}'),
    (lambda: Pong(id=5).to_frame(),
     'HEARTBEAT {"op":"pong","id":5}'),
    (lambda: Goodbye(leaving=True).to_frame(),
     'BYE {"leaving":true}'),
    (lambda: Goodbye().to_frame(),
     'BYE {"leaving":false}'),
    (lambda: Refusal(reason='no').to_frame(),
     'ERROR {"reason":"no"}'),
]


@pytest.mark.parametrize("make, wire", PINS)
def test_each_message_encodes_to_protocol_2s_bytes(make, wire: str) -> None:
    assert pinned(make()) == wire

