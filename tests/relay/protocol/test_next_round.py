"""relay/protocol/next_round.py: what the next round is, one object with one encoding."""

from __future__ import annotations

import json

import pytest
from helpers.wire_pins import pinned

from nebula_cli.relay.net.schema import MessageError, decode, encode
from nebula_cli.relay.protocol.next_round import WHY_CHARS, NextRound
from nebula_cli.relay.protocol.pacing import CODEC_CHARS


def test_it_travels_whole_through_json() -> None:
    nxt = NextRound(h=40, merge=2, codec="topk", why="step 0.1 s (slowest)")
    wire = json.loads(json.dumps({"other": 1, **encode(nxt)}))
    assert decode(NextRound, wire) == nxt
    assert set(encode(nxt)) == {"next_h", "next_merge", "next_codec", "why"}  # protocol 2


def test_what_is_not_said_is_kept_by_the_cluster() -> None:
    assert decode(NextRound, {}) == NextRound() == decode(NextRound, encode(NextRound()))
    old = {"next_h": 5, "why": "w"}  # a sender before overlap and codec choice
    assert decode(NextRound, old) == NextRound(h=5, why="w")


@pytest.mark.parametrize("bad", [{"next_h": 0}, {"next_h": "5"}, {"next_h": True},
                                 {"next_merge": 0}, {"next_merge": 1.5}, {"next_codec": 3},
                                 {"why": ["no"]}])
def test_a_forged_value_is_refused(bad: dict) -> None:
    with pytest.raises(MessageError, match=next(iter(bad))):
        decode(NextRound, bad, what="round decision")


def test_names_and_explanations_are_cut_to_their_caps() -> None:
    nxt = decode(NextRound, {"next_codec": "c" * 100, "why": "w" * 10_000})
    assert len(nxt.codec) == CODEC_CHARS and len(nxt.why) == WHY_CHARS

# Protocol 2's bytes of each message, pinned before the messages were declared once
# (relay/net/schema.py derives every encoding from the fields): they must not move.
PINS = [
    (lambda: NextRound(),
     '{"next_h":null,"next_merge":null,"next_codec":"","why":""}'),
    (lambda: NextRound(h=40, merge=2, codec='topk', why='step 0.1 s (slowest)'),
     '{"next_h":40,"next_merge":2,"next_codec":"topk","why":"step 0.1 s (slowest)"}'),
    (lambda: NextRound(h=5),
     '{"next_h":5,"next_merge":null,"next_codec":"","why":""}'),
]


@pytest.mark.parametrize("make, wire", PINS)
def test_each_message_encodes_to_protocol_2s_bytes(make, wire: str) -> None:
    assert pinned(make()) == wire

