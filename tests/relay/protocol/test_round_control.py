"""relay/protocol/round_control.py on its own: one relay's round control with peers that are a
recording network and a hand-set clock (the whole path, several relays at once, is in
tests/relay/protocol/test_rounds.py)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch
from helpers.plan_defaults import relay_defaults

from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.relay.codecs.registry import get_codec
from nebula_cli.relay.net.limits import Refusals, SyncSize
from nebula_cli.relay.net.wire import Frame, FrameType
from nebula_cli.relay.protocol.agreement import BEHIND, Decision
from nebula_cli.relay.protocol.allreduce import RoundExchange, Schedule
from nebula_cli.relay.protocol.messages import (
    Abort,
    Behind,
    ChunkKind,
    PeerChunk,
    Ready,
    decode_round,
)
from nebula_cli.relay.protocol.next_round import NextRound
from nebula_cli.relay.protocol.pacing import RoundInfo
from nebula_cli.relay.protocol.round_control import HELD_PER_PEER, RoundControl
from nebula_cli.relay.protocol.round_state import RoundState

CLUSTERS = ["a", "b", "c"]


def config(me: str) -> RelayConfig:
    return RelayConfig(job_id="j", cluster=me, clusters=CLUSTERS, peer_listen="127.0.0.1:1",
                       worker_listen="127.0.0.1:2",
                       peers={c: "127.0.0.1:3" for c in CLUSTERS if c != me},
                       tls={"ca": "ca", "cert": "cert", "key": "key"},
                       **relay_defaults(codec="none", round_timeout=1.0, chunk_numel=64,
                                        block_size=64))


class Recorder:
    """Peers that are connected (``up``) and record what is sent to them, decoded."""

    def __init__(self, me: str, up: list[str]) -> None:
        self.me, self.up, self.done = me, up, -1
        self.sent: list[tuple[str, Any]] = []

    def connected(self) -> list[str]:
        return [c for c in CLUSTERS if c in self.up]

    def coordinator(self) -> str:
        return min([self.me, *self.up], key=CLUSTERS.index)

    def send(self, cluster: str, frame: Frame, *, bulk: bool = False) -> bool:
        if cluster not in self.up:
            return False
        msg = decode_round(frame.meta) if frame.type == FrameType.ROUND else frame
        self.sent.append((cluster, msg))
        return True

    def peers_done(self) -> int:
        return self.done

    def finish_view(self) -> dict[str, tuple[int | None, str | None, int]]:
        return {c: (None, None, -1) for c in self.up}

    def departed(self) -> frozenset[str]:
        return frozenset()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def control(me: str = "a", up: list[str] | None = None
            ) -> tuple[RoundControl, RoundState, Recorder, Refusals, Clock]:
    state, net, refusals, clock = RoundState(), Recorder(me, up or []), Refusals(), Clock()
    codecs = {"none": get_codec("none"), "int8": get_codec("int8", block_size=64)}
    ctl = RoundControl(config(me), codecs, state, net,  # type: ignore[arg-type]
                       refusals=refusals, clock=clock)
    return ctl, state, net, refusals, clock


def ready(r: int, attempt: int = 0, numel: int = 8) -> Ready:
    return Ready(round=r, attempt=attempt, ok=True, numel=numel, reason="", lineage="genesis",
                 info=RoundInfo(), codec="none", codec_round=-1)


def test_a_coordinator_with_every_peer_ready_decides_and_tells_them() -> None:
    ctl, _, net, _, clock = control("a", ["c"])
    ctl.on_control("c", ready(0))
    d = ctl.agree(0, 0, "", 8, clock() + 5, RoundInfo(), ("none", -1))
    assert isinstance(d, Decision) and d.present == ("a", "c") and d.coordinator == "a"
    assert d.missing == ("b",)  # b is not connected: nobody waits for it
    assert net.sent == [("c", d)]
    assert ctl.decisions[(0, "a")] == d


def test_a_relay_sends_ready_to_its_coordinator_and_takes_its_decision() -> None:
    ctl, _, net, _, clock = control("b", ["a"])
    d = Decision(round=0, attempt=0, coordinator="a", present=("a", "b"), rejected=(),
                 missing=("c",), numel=8)

    threading.Timer(0.2, ctl.on_control, ("a", d)).start()
    got = ctl.agree(0, 0, "", 8, clock() + 5, RoundInfo(weight=3.0), ("none", -1))
    assert got == d
    to, sent = net.sent[0]
    assert to == "a" and isinstance(sent, Ready) and sent.info == RoundInfo(weight=3.0)


def test_without_a_decision_agree_gives_up_at_its_deadline() -> None:
    ctl, state, _, _, clock = control("b", ["a"])
    assert ctl.agree(0, 0, "", 8, clock() - 1, RoundInfo(), ("none", -1)) is None
    state.stop()
    assert ctl.agree(1, 0, "", 8, clock() + 60, RoundInfo(), ("none", -1)) is None


def test_behind_ends_the_agreement_of_that_round() -> None:
    ctl, _, _, _, clock = control("b", ["a"])
    ctl.on_control("a", Behind(round=0))
    assert ctl.behind_rounds == {0}
    assert ctl.agree(0, 0, "", 8, clock() + 5, RoundInfo(), ("none", -1)) == BEHIND
    ctl.round_done(0)
    assert ctl.behind_rounds == set()


def test_control_ahead_of_this_relays_worker_is_held_then_handled() -> None:
    ctl, _, net, refusals, _ = control("a", ["b", "c"])
    for _ in range(HELD_PER_PEER + 2):
        ctl.on_control("c", ready(9))
    assert len(ctl.held["c"]) == HELD_PER_PEER and ctl.coordinator.next_deadline() is None
    ctl.on_control("c", Behind(round=9))  # a BEHIND that far ahead: refused, not held
    assert refusals.counts == {("round control", "c"): 1}
    ctl.raise_floor(9)  # this relay's worker asks for round 9: the READYs count now
    assert ctl.held == {} and ctl.coordinator.next_deadline() is not None
    assert net.sent == []  # b has not said it is ready


def test_a_decision_relayed_by_another_than_its_coordinator_is_refused() -> None:
    ctl, _, _, refusals, _ = control("b", ["a", "c"])
    ctl.on_control("c", Decision(round=0, attempt=0, coordinator="a", present=("a",), rejected=(),
                                 missing=(), numel=8))
    assert ctl.decisions == {} and refusals.counts == {("round control", "c"): 1}


def test_the_newest_decision_names_the_next_codec_and_merge_step() -> None:
    ctl, _, _, _, _ = control("b", ["a"])
    assert ctl.in_force() == (ctl.codecs["none"], -1)
    ctl.raise_floor(3)  # this relay's worker is at round 3
    ctl.on_control("a", Decision(round=3, attempt=0, coordinator="a", present=("a", "b"),
                                 rejected=(), missing=(), numel=8,
                                 next=NextRound(merge=4, codec="int8")))
    assert ctl.in_force() == (ctl.codecs["int8"], 3) and ctl.merge_in_force == 4
    ctl.on_control("a", Decision(round=2, attempt=0, coordinator="a", present=("a", "b"),
                                 rejected=(), missing=(), numel=8,  # an older round's
                                 next=NextRound(merge=1, codec="none")))
    assert ctl.in_force() == (ctl.codecs["int8"], 3) and ctl.merge_in_force == 4
    ctl.on_control("a", Decision(round=4, attempt=0, coordinator="a", present=("a", "b"),
                                 rejected=(), missing=(), numel=8,
                                 next=NextRound(codec="zstd")))  # not one of ours: ignored
    assert ctl.in_force() == (ctl.codecs["int8"], 3) and ctl.merge_in_force == 4


def exchange(present: tuple[str, ...], me: str = "a") -> RoundExchange:
    return RoundExchange(Schedule(me, present, 1), [(0, 64)], encode=lambda t: t,
                         decode=lambda e: e, send=lambda *a: None, codec="none")


def test_an_abort_or_a_lost_link_fails_the_exchange_it_names() -> None:
    ctl, state, _, _, _ = control("a", ["b", "c"])
    ex, other = exchange(("a", "b")), exchange(("a", "c"))
    state.exchanges[(2, 0, "a")], state.exchanges[(2, 1, "a")] = ex, other
    ctl.on_control("b", Abort(round=2, attempt=0, coord="a", reason="it broke"))
    assert ex.error == "b aborted: it broke" and other.error is None
    ctl.on_link_down("c", "reset")
    assert other.error == "lost the link to c: reset"


def chunk(round_id: int, k: int = 0) -> PeerChunk:
    return PeerChunk.from_frame(Frame(FrameType.PEER_CHUNK, {
        "op": "contrib", "round": round_id, "attempt": 0, "coord": "a", "k": k,
        "codec": "none", "numel": 64, "codec_meta": {}}, bytes(4 * 64)))


def test_chunks_before_their_exchange_are_held_once_the_size_is_known() -> None:
    ctl, state, _, refusals, _ = control("a", ["b", "c"])
    ctl.on_chunk("b", chunk(0))
    assert ctl.early.bytes == 0  # nothing is held before the workers registered
    assert refusals.counts[("chunk", "b")] == 1
    state.register(SyncSize.flat(128))
    ctl.on_chunk("b", chunk(0))
    assert ctl.early.keys() == [(0, 0, "a")] and ctl.early.bytes == chunk(0).held_size()
    ctl.on_chunk("b", chunk(0, k=5))  # the sync size has 2 chunks
    assert refusals.counts[("chunk", "b")] == 2
    ex = exchange(("a", "b"))
    state.exchanges[(1, 0, "a")] = ex
    ctl.on_chunk("c", chunk(1))  # c is not in that round
    assert refusals.counts[("chunk", "c")] == 1 and ex.error is None
    ctl.round_done(0)
    assert ctl.early.keys() == [] and ctl.early.bytes == 0


def test_a_chunk_of_another_codec_fails_its_exchange() -> None:
    ctl, state, _, _, _ = control("a", ["b"])
    ex = RoundExchange(Schedule("a", ("a", "b"), 1), [(0, 64)], encode=lambda t: t,
                       decode=lambda e: torch.zeros(64), send=lambda *a: None, codec="int8")
    state.exchanges[(1, 0, "a")] = ex
    ctl.on_chunk("b", chunk(1))
    assert ex.error is not None and "encoded with none, expected int8" in ex.error


@pytest.mark.parametrize("kind", [ChunkKind.CONTRIB, ChunkKind.AVG])
def test_a_chunk_of_the_round_reaches_its_exchange(kind: ChunkKind) -> None:
    ctl, state, _, _, _ = control("a", ["b"])
    got: list[tuple[str, str, int]] = []
    ex = exchange(("a", "b"))
    ex.add_contrib = lambda src, k, enc: got.append(("contrib", src, k))  # type: ignore
    ex.add_avg = lambda src, k, enc: got.append(("avg", src, k))  # type: ignore
    state.exchanges[(1, 0, "a")] = ex
    ctl.on_chunk("b", dataclasses.replace(chunk(1), kind=kind))
    assert got == [(kind.value, "b", 0)] and ex.error is None


def test_a_coordinator_closes_rounds_some_relay_completed_and_decides_at_the_deadline() -> None:
    ctl, _, net, _, clock = control("a", ["b", "c"])
    ctl.raise_floor(3)  # this relay's worker is at round 3
    ctl.on_control("c", ready(2))
    net.done = 2  # b has completed round 2 already
    ctl.on_progress()
    assert net.sent == [("c", Behind(round=2))]
    ctl.on_control("c", ready(3))
    assert ctl.tick() == clock() + 1.0  # decided at the round's deadline
    clock.t += 1.0
    ctl.tick()
    (to_b, d), (to_c, d2) = net.sent[1:]
    assert isinstance(d, Decision) and d == d2 and (to_b, to_c) == ("b", "c")
    assert d.present == ("c",) and d.missing == ("a", "b")
