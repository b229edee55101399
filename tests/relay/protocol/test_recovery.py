"""relay/protocol/recovery.py on its own: handed a RoundState and a network that answers from
a table (peers' averages and states), it fetches, catches up, resyncs, averages alone and picks
the final state. The whole path, several relays at once, is in
tests/relay/protocol/test_rounds.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from helpers.plan_defaults import relay_defaults

from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.relay.codecs.registry import get_codec
from nebula_cli.relay.protocol.messages import FetchRequest, ResultAsk, StateAsk
from nebula_cli.relay.protocol.recovery import Recovery
from nebula_cli.relay.protocol.results import Average, GlobalState, RoundMode
from nebula_cli.relay.protocol.round_state import Phase, RoundState

N = 16


def config(clusters: list[str], me: str = "b") -> RelayConfig:
    return RelayConfig(job_id="j", cluster=me, clusters=clusters, peer_listen="127.0.0.1:1",
                       worker_listen="127.0.0.1:2",
                       peers={c: "127.0.0.1:3" for c in clusters if c != me},
                       tls={"ca": "ca", "cert": "cert", "key": "key"},
                       **relay_defaults(codec="none", round_timeout=1.0))


class TableNet:
    """Peers that answer fetches from ``results`` / ``states`` and record what was asked."""

    def __init__(self) -> None:
        self.results: dict[str, Average] = {}
        self.states: dict[str, GlobalState] = {}
        self.finished: dict[str, tuple[int | None, str | None, int]] = {}
        self.left: frozenset[str] = frozenset()
        self.asked: list[tuple[str, FetchRequest]] = []
        self.done = -1

    def fetch(self, cluster: str, ask: FetchRequest, timeout: float) -> Any:
        self.asked.append((cluster, ask))
        if isinstance(ask, ResultAsk):
            avg = self.results.get(cluster)
            return avg if avg is not None and avg.round_id == ask.round else None
        st = self.states.get(cluster)
        return st if st is not None and st.round_id >= ask.min_round else None

    def holders(self, round_id: int) -> list[str]:
        return [c for c, a in self.results.items() if a.round_id == round_id]

    def state_sources(self) -> list[tuple[str, int | None]]:
        return sorted(((c, s.round_id) for c, s in self.states.items()), key=lambda x: -x[1])

    def finish_view(self) -> dict[str, tuple[int | None, str | None, int]]:
        return dict(self.finished)

    def departed(self) -> frozenset[str]:
        return self.left

    def peers_done(self) -> int:
        return self.done


class Events:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, msg: str, *args: Any) -> None:
        self.lines.append(msg % args)


def recovery(clusters: list[str] | None = None, me: str = "b",
             clock: Any = None) -> tuple[Recovery, RoundState, TableNet, Events]:
    state, net, events = RoundState(), TableNet(), Events()
    rec = Recovery(config(clusters or ["a", "b", "c"], me), state, net,  # type: ignore[arg-type]
                   event=events, clock=clock or (lambda: 0.0))
    return rec, state, net, events


def test_a_missed_average_is_fetched_from_the_first_peer_in_the_jobs_order_that_has_it() -> None:
    rec, state, net, _ = recovery(["a", "b", "c", "d"])
    net.results["d"] = Average(4, ["c", "d"], ["a"], torch.full((N,), 2.0), "int8")
    net.results["c"] = Average(4, ["c", "d"], ["a"], torch.full((N + 1,), 9.0))  # wrong size
    out = rec.recover(4, ["d", "b", "c"], N, wait=0.5)
    assert out is not None and out.mode == RoundMode.FETCHED and out.codec == "int8"
    assert torch.equal(out.tensor, torch.full((N,), 2.0))
    assert (out.present, out.rejected, out.missing) == (["c", "d"], ["a"], ["b"])
    assert [c for c, _ in net.asked] == ["c", "d"]  # never itself; c first (job order)
    assert net.asked[0][1] == ResultAsk(round=4, wait=0.5)
    assert state.average is not None and state.average.round_id == 4  # served on to others
    assert state.phase[4] == Phase.RECOVERING
    assert rec.recover(5, ["c", "d"], N) is None


def test_catching_up_takes_a_held_average_then_a_peers_then_the_newest_state() -> None:
    rec, state, net, events = recovery()
    state.average = Average(3, ["a"], [], torch.ones(N))
    cached = rec.catch_up(3, N, "a peer is ahead")
    assert cached.mode == RoundMode.CACHED and net.asked == []
    assert "round 3: this cluster is behind (a peer is ahead)" in events.lines[0]
    net.done = 8
    net.states = {"a": GlobalState(8, torch.full((N,), 8.0), "lin-a"),
                  "c": GlobalState(6, torch.full((N,), 6.0), "lin-c")}
    out = rec.catch_up(4, N, "behind")
    assert out.mode == RoundMode.CATCH_UP and out.round_id == 8 and out.lineage == "lin-a"
    assert out.global_state is not None and torch.equal(out.global_state, torch.full((N,), 8.0))
    assert not out.present and torch.equal(out.tensor, torch.zeros(N))
    net.states = {}
    failed = rec.catch_up(5, N, "behind")
    assert failed.mode == RoundMode.FAILED and torch.equal(failed.tensor, torch.zeros(N))


def test_a_diverged_cluster_takes_a_present_peers_state_of_the_round() -> None:
    rec, _, net, events = recovery()
    net.states = {"a": GlobalState(1, torch.ones(N)),  # too old
                  "c": GlobalState(2, torch.full((N,), 2.0), "lin-c")}
    out = rec.resync(2, ["a", "c"], N)
    assert out.mode == RoundMode.RESYNC and out.lineage == "lin-c" and out.round_id == 2
    assert "differs from that of a, c" in events.lines[0]
    assert rec.resync(3, ["a", "c"], N).mode == RoundMode.FAILED


def test_alone_a_cluster_gets_its_own_contribution_as_its_codec_sends_it() -> None:
    rec, state, _, _ = recovery()
    codec = get_codec("int8", block_size=8)
    x = torch.randn(N)
    out = rec.alone(2, x, N, codec)
    assert out.mode == RoundMode.ALONE and out.present == ["b"] and out.missing == ["a", "c"]
    assert torch.equal(out.tensor, codec.decode(codec.encode(x))) and out.codec == "int8"
    assert state.average is not None and state.average.present == ["b"]
    rejected = rec.alone(3, None, N, codec)  # its own contribution was refused
    assert rejected.present == [] and rejected.rejected == ["b"]
    assert torch.equal(rejected.tensor, torch.zeros(N))


def test_the_best_state_is_the_newest_here_or_at_a_peer() -> None:
    rec, state, net, _ = recovery()
    assert rec.best_state() is None
    state.published = GlobalState(4, torch.ones(N))
    net.states = {"a": GlobalState(3, torch.zeros(N))}
    assert rec.best_state() is state.published  # ours is newer: nobody asked
    assert net.asked == []
    net.states["c"] = GlobalState(6, torch.full((N,), 6.0))
    best = rec.best_state()
    assert best is not None and best.round_id == 6
    assert net.asked == [("c", StateAsk(min_round=6, wait=0.0))]


@pytest.mark.parametrize("theirs, mine, want", [
    ((5, "x", 5), 4, "c"),  # c finished last: take its state
    ((4, "x", 4), 4, None),  # a tie goes to the earlier cluster in the job's order (b)
    ((5, "same", 5), 4, None),  # c finished last, but on our lineage: nothing to take
])
def test_the_final_state_is_that_of_the_cluster_that_finished_last(
        theirs: tuple, mine: int, want: str | None) -> None:
    rec, state, net, _ = recovery()
    state.done_round, state.lineage = mine, "same"
    state.mark_finished()
    net.finished = {"a": (3, "a's", 3), "c": theirs}  # a finished first: never the one
    net.states = {"c": GlobalState(5, torch.full((N,), 5.0), "lin-c")}
    got = rec.final_state(None)
    if want is None:
        assert got is None and state.lineage == "same"
    else:
        assert got is not None and got.round_id == 5 and state.lineage == "lin-c"


def test_the_end_does_not_wait_forever_for_a_peer_that_still_trains() -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 0.3  # each look at the clock: a while later
        return now[0]

    rec, state, net, events = recovery(clock=clock)
    state.mark_finished()
    net.finished = {"c": (None, "x", 2)}  # c trains on
    net.left = frozenset({"a"})
    assert rec.final_state(1.0) is None
    assert "peers c have not finished after 1 s" in events.lines[-1]


def test_a_peer_not_connected_at_the_end_is_waited_for_and_its_state_taken_if_it_is_last(
        ) -> None:
    """c's link is down as b finishes (a cut link, a host that went down): b waits for c to
    come back and finish instead of ending alone (seen in the soak: two parameter sets)."""
    rec, state, net, events = recovery()
    state.done_round, state.lineage = 4, "lin-b"
    state.mark_finished()
    net.finished = {"a": (4, "lin-b", 4)}  # a finished with b; c is not connected
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(rec.final_state, None)
        time.sleep(1.2)
        assert not got.done()
        assert "peers c are not connected as this cluster finishes" in events.lines[-1]
        net.states = {"c": GlobalState(6, torch.full((N,), 6.0), "lin-c")}
        net.finished = {"a": (4, "lin-b", 4), "c": (6, "lin-c", 6)}  # back, finished later
        st = got.result(timeout=5)
    assert st is not None and st.round_id == 6 and state.lineage == "lin-c"


def test_a_peer_whose_relay_said_goodbye_is_not_waited_for_at_the_end() -> None:
    """A cluster nebula stopped (a lost cluster under `min_clusters`) left the job: its relay
    said goodbye; the end does not wait for it."""
    rec, state, net, events = recovery()
    state.mark_finished()
    net.left = frozenset({"a", "c"})
    assert rec.final_state(None) is None and events.lines == []


def test_a_peer_that_does_not_come_back_is_given_up_after_the_final_stall() -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 100.0
        return now[0]

    rec, state, net, events = recovery(clock=clock)
    state.mark_finished()
    net.left = frozenset({"a"})  # c is not connected and never comes back
    assert rec.final_state(None) is None
    assert "peers c made no round in 600 s" in events.lines[-1]
