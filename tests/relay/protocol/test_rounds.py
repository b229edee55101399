"""The relay's round driver without sockets: several `Rounds` joined by an in-memory network
(a delivery thread per relay), and the pure decisions and limits it takes. The socket module is
made unusable for these tests, so nothing here can open one."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from helpers.rounds_hub import Hub, run_round

from nebula_cli.codecs.topk.params import TopKParams
from nebula_cli.relay.codecs.registry import get_codec
from nebula_cli.relay.net.limits import (
    CHUNK_SLACK,
    EARLY_COPIES,
    EARLY_FRAME_COST,
    MAX_ROUNDS_AHEAD,
    EarlyChunks,
    LimitExceeded,
    SyncSize,
    held_size,
)
from nebula_cli.relay.net.schema import MessageError, encode
from nebula_cli.relay.net.wire import Frame, FrameType
from nebula_cli.relay.protocol.agreement import Decision
from nebula_cli.relay.protocol.messages import PeerChunk, decode_round
from nebula_cli.relay.protocol.results import GlobalState
from nebula_cli.relay.protocol.round_state import Step, after_decision


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the round driver opened a socket")

    monkeypatch.setattr(socket, "socket", forbidden)
    monkeypatch.setattr(socket, "create_connection", forbidden)


@pytest.fixture
def hub3() -> Iterator[Hub]:
    hub = Hub(["a", "b", "c"])
    try:
        yield hub
    finally:
        hub.close()


def test_three_relays_average_exactly_without_sockets(hub3: Hub) -> None:
    gen = torch.Generator().manual_seed(4)
    for r in range(2):
        xs = {c: torch.randn(1000, generator=gen) for c in hub3.order}
        out = run_round(hub3, r, xs)
        want = (xs["a"] + xs["b"] + xs["c"]) / 3
        for c in hub3.order:
            assert out[c].present == ["a", "b", "c"] and out[c].mode == "shard"
            assert torch.equal(out[c].tensor, out["a"].tensor)
            assert torch.allclose(out[c].tensor, want, atol=1e-6)
    assert [o.round_id for o in hub3.outcomes["b"]] == [0, 1]
    assert all(r.state.done_round == 1 for r in hub3.rounds.values())
    for r in hub3.rounds.values():  # one round's average held, the newest (peers may fetch it)
        assert list(r.state.outcomes) == [1] and r.state.average is not None
        assert r.state.average.tensor is r.state.outcomes[1].tensor


@pytest.mark.parametrize("clusters", [["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"]])
def test_sparse_contributions_are_summed_not_dropped(clusters: list[str]) -> None:
    """topk: clusters pick different coordinates; every relay sends its encoding to every other
    (no re-encoded average, whatever the number of clusters) and ends with the exact mean of the
    decoded parts, the same bits everywhere."""
    hub = Hub(clusters, codec="topk", density=0.02, bits=2, error_feedback=False,
              chunk_numel=512, block_size=256)
    try:
        gen = torch.Generator().manual_seed(7)
        xs = {c: torch.randn(2000, generator=gen) for c in clusters}
        out = run_round(hub, 0, xs)
    finally:
        hub.close()
    codec = get_codec("topk", density=0.02, bits=2)
    parts = {c: torch.cat([codec.decode(codec.encode(x[lo:lo + 512]))  # chunk by chunk
                           for lo in range(0, 2000, 512)]) for c, x in xs.items()}
    mean = torch.stack([parts[c] for c in sorted(parts)]).sum(0) / len(parts)
    support = torch.stack(list(parts.values())).ne(0).any(0)
    assert int(support.sum()) > 5 * 8 * len(clusters) * 0.9  # they did pick different ones
    for c in clusters:
        assert out[c].mode == "direct"
        assert torch.equal(out[c].tensor, mean)


def test_the_error_feedback_decays_by_the_rounds_codec() -> None:
    """topk with error feedback at the plan's decay (topk's 0.7): the second round encodes
    x2 + 0.7 * (what the first left out), chunk by chunk, on every relay."""
    clusters = ["a", "b"]
    hub = Hub(clusters, codec="topk", density=0.02, bits=2, error_feedback=True,
              chunk_numel=512, block_size=256)
    assert TopKParams.feedback_decay == 0.7
    try:
        assert all(r.feedback is not None and r.feedback.decay(get_codec("topk")) == 0.7
                   for r in hub.rounds.values())
        gen = torch.Generator().manual_seed(8)
        first = {c: torch.randn(2000, generator=gen) for c in clusters}
        second = {c: torch.randn(2000, generator=gen) for c in clusters}
        run_round(hub, 0, first)
        out = run_round(hub, 1, second)
    finally:
        hub.close()
    codec = get_codec("topk", density=0.02, bits=2)

    def chunked(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([codec.decode(codec.encode(x[lo:lo + 512]))
                          for lo in range(0, 2000, 512)])
    sent = {c: chunked(second[c] + 0.7 * (first[c] - chunked(first[c]))) for c in clusters}
    mean = (sent["a"] + sent["b"]) / 2
    for c in clusters:
        assert torch.allclose(out[c].tensor, mean, atol=1e-6)
    undecayed = {c: chunked(second[c] + first[c] - chunked(first[c])) for c in clusters}
    assert not torch.allclose(out["a"].tensor, (undecayed["a"] + undecayed["b"]) / 2)


def test_a_late_relay_is_left_out_and_fetches_the_average(hub3: Hub) -> None:
    xs = {c: torch.full((300,), float(i)) for i, c in enumerate(hub3.order)}
    out = run_round(hub3, 0, xs, delays={"c": 1.6})
    assert out["a"].present == ["a", "b"] and out["a"].missing == ["c"]
    assert torch.equal(out["a"].tensor, torch.full((300,), 0.5))
    assert out["c"].mode in ("fetched", "cached") and torch.equal(out["c"].tensor,
                                                                 out["a"].tensor)
    assert any("left out" in e or "behind" in e for e in hub3.events["c"]), hub3.events["c"]


def test_a_relay_cut_off_averages_alone_then_catches_up_from_a_state() -> None:
    hub = Hub(["a", "b"])
    try:
        hub.up = {"a", "b"}
        run_round(hub, 0, {c: torch.ones(100) for c in hub.order})
        hub.up = {"a"}  # b's links are gone
        lone = run_round(hub, 1, {"b": torch.full((100,), 3.0)})["b"]
        assert lone.mode == "alone" and lone.present == ["b"]
        assert torch.equal(lone.tensor, torch.full((100,), 3.0))
        hub.rounds["a"].state.publish(GlobalState(5, torch.full((100,), 7.0)))
        hub.rounds["a"].state.done_round = 5
        hub.up = {"a", "b"}
        back = run_round(hub, 2, {"b": torch.ones(100)})["b"]
        assert back.mode == "catch-up" and back.round_id == 5
        assert back.global_state is not None and torch.equal(back.global_state,
                                                             torch.full((100,), 7.0))
    finally:
        hub.close()


def test_after_decision_is_a_pure_choice() -> None:
    d = Decision(round=3, attempt=0, coordinator="a", present=("a", "b"), rejected=("c",),
                 missing=(), numel=10)
    assert after_decision("a", d, own_ok=True) == Step.EXCHANGE
    assert after_decision("a", d, own_ok=False) == Step.LEFT_OUT
    assert after_decision("c", d, own_ok=True) == Step.LEFT_OUT
    nobody = Decision(round=3, attempt=0, coordinator="a", present=(), rejected=("a",),
                      missing=("b",), numel=10)
    assert after_decision("a", nobody, own_ok=True) == Step.EMPTY


def test_control_for_far_rounds_and_forged_decisions_is_refused(
        hub3: Hub, caplog: pytest.LogCaptureFixture) -> None:
    a = hub3.rounds["a"].control

    def control(meta: dict[str, Any]) -> None:  # as a ROUND frame from b comes in
        a.on_control("b", decode_round(meta))

    far = Decision(round=10**6, attempt=0, coordinator="b", present=("b",), rejected=(), missing=(),
                   numel=4)
    control({"op": "start", **encode(far)})
    forged = Decision(round=0, attempt=0, coordinator="c", present=("c",), rejected=(), missing=(),
                      numel=4)
    control({"op": "start", **encode(forged)})  # c's decision, sent by b
    control({"op": "behind", "round": 10**6})
    control({"op": "ready", "round": 10**6, "attempt": 0, "ok": True, "numel": 4})
    assert a.decisions == {} and a.behind_rounds == set()
    assert a.coordinator.next_deadline() is None  # no collection opened
    assert "refused round control from b" in caplog.text
    with pytest.raises(MessageError, match="attempt"):
        control({"op": "ready", "round": 0, "attempt": 99, "ok": True, "numel": 4})


def test_early_chunks_are_held_within_the_sync_size_only(hub3: Hub) -> None:
    a = hub3.rounds["a"].control

    def chunk(r: int, k: int, n: int = 64) -> Frame:
        return Frame(FrameType.PEER_CHUNK, {"op": "contrib", "round": r, "attempt": 0,
                                            "coord": "a", "k": k, "codec": "none", "numel": n,
                                            "codec_meta": {}}, bytes(4 * n))

    def send(frame: Frame) -> None:  # as a PEER_CHUNK frame from b comes in
        a.on_chunk("b", PeerChunk.from_frame(frame))

    send(chunk(0, 0))  # before the workers registered: nothing is held
    assert a.early.bytes == 0
    hub3.rounds["a"].state.register(SyncSize.flat(512))  # 2 chunks of 256
    send(chunk(0, 0))
    one = held_size(chunk(0, 0))
    assert a.early.bytes == one
    send(chunk(0, 0))  # twice
    send(chunk(0, 7))  # no such chunk
    send(chunk(MAX_ROUNDS_AHEAD + 5, 0))  # far in the future
    assert a.early.bytes == one and a.early.keys() == [(0, 0, "a")]
    with pytest.raises(LimitExceeded):
        hub3.rounds["a"].state.register(SyncSize.flat(513))


def test_early_chunk_budget_is_a_few_copies_of_the_sync_size_per_sender() -> None:
    """A sender past its budget is refused alone: another cluster's chunks are still held
    (an attacker with a certificate of the job once filled a shared budget, and the real
    peer's chunks for the next round were refused: the round stalled for 30 s)."""
    early = EarlyChunks(["a", "b", "c"], max_attempts=3)
    numel = 100_000  # (CHUNK_SLACK is small beside it)
    frame = Frame(FrameType.PEER_CHUNK, {}, bytes(4 * numel))
    held = 0
    with pytest.raises(LimitExceeded, match="its early chunks beyond"):
        for attempt in range(3):
            early.add((1, attempt, "a"), "c", 0, frame, done=0, sync_numel=numel,
                      num_chunks=1)
            held += 1
    assert held == EARLY_COPIES and early.held_from("c") == EARLY_COPIES * held_size(frame)
    for attempt in range(EARLY_COPIES):
        early.add((1, attempt, "a"), "b", 0, frame, done=0, sync_numel=numel, num_chunks=1)
    assert early.held_from("b") == early.held_from("c")
    assert early.bytes == 2 * EARLY_COPIES * held_size(frame)
    with pytest.raises(LimitExceeded, match="not a cluster of this job"):
        early.add((1, 0, "a"), "zz", 0, frame, done=0, sync_numel=numel, num_chunks=1)
    assert len(early.pop((1, 0, "a"))) == 2 and early.held_from("b") == held_size(frame)
    early.drop_through(1)
    assert early.bytes == 0 and early.held_from("b") == early.held_from("c") == 0


def test_zero_length_chunks_under_made_up_attempts_and_coordinators_are_bounded() -> None:
    """An attacker's chunks: attempts and coordinators of its choosing, empty payloads, a
    large meta. Nothing outside the job's rounds is held, and what is held is counted."""
    clusters, numel, chunks = ["a", "b", "c"], 1024, 4
    early = EarlyChunks(clusters, max_attempts=3)
    refused = 0
    for i in range(20_000):
        meta = {"pad": "x" * 4000, "i": i}
        key = (1 + i % 3, i % 7, ["a", "b", "c", "zz", ""][i % 5])
        try:
            early.add(key, "b", i % chunks, Frame(FrameType.PEER_CHUNK, meta, b""), done=0,
                      sync_numel=numel, num_chunks=chunks)
        except LimitExceeded:
            refused += 1
    keys = list(early.keys())
    assert keys and all(k[1] < 3 and k[2] in clusters for k in keys)
    held = [f for key in keys for _, f in early.pop(key)]
    assert refused == 20_000 - len(held) and len(held) <= 2 * 3 * 3 * chunks
    budget = EARLY_COPIES * (4 * numel + chunks * EARLY_FRAME_COST) + CHUNK_SLACK
    assert sum(held_size(f) for f in held) <= budget


def publish_after(hub: Hub, cluster: str, round_id: int, theta: torch.Tensor) -> threading.Thread:
    """What a cluster's rank 0 does after a round: publish theta_global (here, once the
    relay's outcome for ``round_id`` is out)."""
    def run() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if any(o.round_id == round_id for o in hub.outcomes[cluster]):
                hub.rounds[cluster].state.publish(GlobalState(round_id, theta))
                return
            time.sleep(0.01)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_lineage_winner_is_the_majority_then_the_earliest_known() -> None:
    from nebula_cli.relay.protocol.lineage import UNKNOWN, diverged, winner

    order = ["a", "b", "c"]
    assert winner({"a": "x", "b": "y", "c": "y"}, order) == "y"
    assert diverged({"a": "x", "b": "y", "c": "y"}, order) == ["a"]
    assert winner({"a": "x", "b": "y"}, order) == "x"  # a tie: the earliest cluster's
    assert diverged({"a": UNKNOWN, "b": "y"}, order) == ["a"]  # unknown never wins
    assert diverged({"a": UNKNOWN, "b": UNKNOWN}, order) == []  # nobody knows: nobody loses
    assert diverged({"a": "x", "c": "x"}, order) == []


def test_relays_that_ended_a_round_differently_converge_on_the_next_one() -> None:
    """a and b are cut apart for round 1 (each averages alone: their global states differ).
    When they meet again the lineage in their READY tells them apart; b (later in the job's
    order, a tie) takes a's published state, and round 3 is joint again."""
    hub = Hub(["a", "b"])
    try:
        run_round(hub, 0, {c: torch.ones(100) for c in hub.order})
        assert hub.rounds["a"].state.lineage == hub.rounds["b"].state.lineage != "genesis"
        hub.up = {"a"}
        alone = run_round(hub, 1, {"a": torch.full((100,), 2.0), "b": torch.full((100,), 3.0)})
        assert alone["a"].mode == alone["b"].mode == "alone"
        assert hub.rounds["a"].state.lineage != hub.rounds["b"].state.lineage
        hub.up = {"a", "b"}
        theta_a = torch.full((100,), 9.0)
        publisher = publish_after(hub, "a", 2, theta_a)
        healed = run_round(hub, 2, {c: torch.ones(100) for c in hub.order})
        publisher.join(5)
        assert healed["a"].present == ["a"] and healed["a"].mode == "alone"
        assert healed["b"].mode == "resync" and healed["b"].round_id == 2
        assert healed["b"].global_state is not None
        assert torch.equal(healed["b"].global_state, theta_a)
        assert any("differs from that of a" in e for e in hub.events["b"]), hub.events["b"]
        assert hub.rounds["a"].state.lineage == hub.rounds["b"].state.lineage
        joint = run_round(hub, 3, {c: torch.full((100,), float(i)) for i, c in
                                   enumerate(hub.order)})
        assert joint["a"].present == joint["b"].present == ["a", "b"]
        assert torch.equal(joint["a"].tensor, joint["b"].tensor)
    finally:
        hub.close()


def test_the_odd_one_out_resyncs_even_when_it_coordinates(hub3: Hub) -> None:
    """a (the coordinator) diverged while b and c stayed in step: the majority's lineage wins,
    a takes b's state; a relay restarted mid-job (unknown lineage) resyncs too."""
    run_round(hub3, 0, {c: torch.ones(64) for c in hub3.order})
    hub3.rounds["a"].state.lineage = "a-alone"  # as if a had averaged alone in some round
    theta_b = torch.full((64,), 5.0)
    publisher = publish_after(hub3, "b", 1, theta_b)
    out = run_round(hub3, 1, {c: torch.ones(64) for c in hub3.order})
    publisher.join(5)
    assert out["b"].present == out["c"].present == ["b", "c"]
    assert out["a"].mode == "resync" and torch.equal(out["a"].global_state, theta_b)
    assert len({r.state.lineage for r in hub3.rounds.values()}) == 1

    hub3.rounds["c"].state.lineage = None  # a relay that restarted: its first round is round 2
    theta_a = torch.full((64,), 6.0)
    publisher = publish_after(hub3, "a", 2, theta_a)
    out = run_round(hub3, 2, {c: torch.ones(64) for c in hub3.order})
    publisher.join(5)
    assert out["a"].present == ["a", "b"] and out["c"].mode == "resync"
    assert torch.equal(out["c"].global_state, theta_a)


def test_a_coordinator_dying_while_it_sends_start_stalls_the_round_briefly() -> None:
    """a (the coordinator) sends its decision to b, then dies before c hears it. b's exchange
    fails (a is gone), c still waits for a decision: the next coordinator (b) takes c's READY
    for the old attempt and b's for the retry into one decision, without waiting for the
    round's deadline (30 s here) or for a."""
    hub = Hub(["a", "b", "c"], round_timeout=30.0)
    try:
        run_round(hub, 0, {c: torch.ones(64) for c in hub.order})
        net_a = hub.rounds["a"].net
        real_send = net_a.send

        def send(cluster: str, frame: Frame, *, bulk: bool = False) -> bool:
            if frame.type == FrameType.ROUND and frame.meta.get("op") == "start" \
                    and cluster == "c":
                hub.cut("a")  # a dies with its START to c unsent
                return False
            return real_send(cluster, frame, bulk=bulk)

        net_a.send = send  # type: ignore[method-assign]
        xs = {c: torch.full((64,), float(i)) for i, c in enumerate(hub.order)}
        t0 = time.monotonic()
        out = run_round(hub, 1, xs)
        took = time.monotonic() - t0
        assert out["b"].present == out["c"].present == ["b", "c"]
        assert torch.equal(out["b"].tensor, out["c"].tensor)
        assert torch.equal(out["b"].tensor, torch.full((64,), 1.5))
        assert took < 15, f"the round waited {took:.1f} s"
        # b either tried a's decision and retried, or had already asked itself (the new
        # coordinator) first; either way c's READY for attempt 0 counted in b's decision
        assert out["c"].round_id == 1 and out["b"].mode == out["c"].mode == "direct"
    finally:
        hub.close()


def test_clusters_that_end_at_different_rounds_end_with_the_same_state() -> None:
    """a's workers finish after round 0 while b makes one more round (alone: a will never be
    ready again, so b does not wait for it). a waits for b to finish, then takes b's state;
    b, which finished last, keeps its own."""
    hub = Hub(["a", "b"], round_timeout=30.0)
    try:
        run_round(hub, 0, {c: torch.ones(32) for c in hub.order})
        hub.rounds["a"].state.mark_finished()
        with ThreadPoolExecutor(1) as pool:
            a_final = pool.submit(hub.rounds["a"].recovery.final_state, None)
            t0 = time.monotonic()
            last = hub.rounds["b"].local_round(1, torch.full((32,), 4.0))
            assert last.present == ["b"] and time.monotonic() - t0 < 10  # no 30 s deadline
            theta_b = torch.full((32,), 3.0)
            hub.rounds["b"].state.publish(GlobalState(1, theta_b))
            assert not a_final.done()  # a still waits: b trains
            hub.rounds["b"].state.mark_finished()
            assert hub.rounds["b"].recovery.final_state(None) is None  # b finished last: its own
            got = a_final.result(timeout=10)
        assert got is not None and got.round_id == 1 and torch.equal(got.tensor, theta_b)
        assert hub.rounds["a"].state.lineage == hub.rounds["b"].state.lineage
    finally:
        hub.close()


def test_a_cluster_cut_off_as_the_other_finishes_is_waited_for_and_both_end_alike() -> None:
    """b's link is cut as a's workers finish (seen in the soak: a cut link and a host reboot
    at the end, then each cluster ended with its own parameters). a waits for b; b comes back,
    makes its last round and finishes; a takes b's state."""
    hub = Hub(["a", "b"], round_timeout=30.0)
    try:
        run_round(hub, 0, {c: torch.ones(32) for c in hub.order})
        hub.cut("b")
        hub.rounds["a"].state.mark_finished()
        with ThreadPoolExecutor(1) as pool:
            a_final = pool.submit(hub.rounds["a"].recovery.final_state, None)
            time.sleep(1.0)
            assert not a_final.done()  # the old code ended a alone here
            assert any("b are not connected" in e for e in hub.events["a"]), hub.events["a"]
            hub.rejoin("b")
            last = hub.rounds["b"].local_round(1, torch.full((32,), 4.0))
            assert last.present == ["b"]
            theta_b = torch.full((32,), 3.0)
            hub.rounds["b"].state.publish(GlobalState(1, theta_b))
            hub.rounds["b"].state.mark_finished()
            assert hub.rounds["b"].recovery.final_state(None) is None  # b finished last
            got = a_final.result(timeout=10)
        assert got is not None and got.round_id == 1 and torch.equal(got.tensor, theta_b)
    finally:
        hub.close()


def test_a_cluster_that_left_the_job_is_not_waited_for_at_the_end() -> None:
    """b was stopped (a lost cluster under `min_clusters`): its relay said goodbye, and a's
    end does not wait for it."""
    hub = Hub(["a", "b"], round_timeout=30.0)
    try:
        run_round(hub, 0, {c: torch.ones(32) for c in hub.order})
        hub.leave("b")
        hub.rounds["a"].state.mark_finished()
        t0 = time.monotonic()
        assert hub.rounds["a"].recovery.final_state(None) is None
        assert time.monotonic() - t0 < 2
    finally:
        hub.close()


def test_resumed_workers_ahead_of_fresh_relays_meet_at_once() -> None:
    """After `nebula resume` every relay starts at round -1 while the workers go on from their
    checkpoint's round: a peer's READY for round 7 that comes before this relay's own worker
    asked for it is held, not refused, and the round is joint without waiting for the deadline
    (seen: every resumed job stalled its first round for the whole round timeout)."""
    hub = Hub(["a", "b"], round_timeout=60.0)
    try:
        gen = torch.Generator().manual_seed(5)
        xs = {c: torch.randn(300, generator=gen) for c in hub.order}
        t0 = time.monotonic()
        out = run_round(hub, 7, xs, delays={"a": 1.0})  # a's worker comes a second later
        assert time.monotonic() - t0 < 15
        for c in hub.order:
            assert out[c].present == ["a", "b"] and out[c].round_id == 7
        assert torch.equal(out["a"].tensor, out["b"].tensor)
        assert torch.allclose(out["a"].tensor, (xs["a"] + xs["b"]) / 2, atol=1e-6)
    finally:
        hub.close()
