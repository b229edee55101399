"""How often clusters sync: the relays' choice of H (``inner_steps: auto``), the weights of an
average (time-based rounds: clusters of unequal speed), and the worker's round clock."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cadence_spec import BASE
from helpers.rounds_hub import Hub, run_round
from helpers.specs import one, write
from helpers.sync_reference import CFG, TwoClusterAverager, plain_step, small_model

from nebula_cli.config import relay_plan, sync_plan
from nebula_cli.config.relay_config import AutoSteps
from nebula_cli.config.spec import load_spec
from nebula_cli.relay.net.schema import MessageError, decode, encode
from nebula_cli.relay.protocol.agreement import Coordinator, Decision
from nebula_cli.relay.protocol.allreduce import ordered_mean
from nebula_cli.relay.protocol.next_round import NextRound
from nebula_cli.relay.protocol.pacing import (
    RoundInfo,
    choose_inner_steps,
    choose_merge_steps,
    round_weights,
)
from nebula_cli.runtime.cadence import Cadence
from nebula_cli.runtime.cluster_share import ClusterShare
from nebula_cli.runtime.sync import OuterSync

AUTO = AutoSteps(target_utilization=0.9, min_steps=5, max_steps=200, overlap=False)


# ---------------------------------------------------------------- the relays' choice of H


def test_h_is_the_smallest_that_reaches_the_target() -> None:
    # 0.2 s a step, 2 s a round, 90 %: H t / (H t + c) >= 0.9  <=>  H >= 9 * 2 / 0.2 = 90
    infos = {"a": RoundInfo(step_s=0.2, comm_s=2.0), "b": RoundInfo(step_s=0.1, comm_s=3.0)}
    h, why = choose_inner_steps(AUTO, infos) or (0, "")
    assert h == 90 and "H 90" in why
    assert 90 * 0.2 / (90 * 0.2 + 2.0) >= 0.9 > 89 * 0.2 / (89 * 0.2 + 2.0)
    # the link four times slower: four times the H; restored: back down
    assert choose_inner_steps(AUTO, {"a": RoundInfo(step_s=0.2, comm_s=8.0)})[0] == 200
    assert choose_inner_steps(AUTO, {"a": RoundInfo(step_s=0.2, comm_s=0.1)})[0] == 5


def test_h_with_overlap_only_has_to_cover_the_round() -> None:
    overlap = AutoSteps(target_utilization=0.8, min_steps=1, max_steps=1000, overlap=True)
    assert choose_inner_steps(overlap, {"a": RoundInfo(step_s=0.5, comm_s=4.0)})[0] == 10


def test_h_is_clamped_and_says_so() -> None:
    h, why = choose_inner_steps(AUTO, {"a": RoundInfo(step_s=0.01, comm_s=60.0)}) or (0, "")
    assert h == 200 and "capped at max_inner_steps" in why


def test_no_measurement_no_choice() -> None:
    assert choose_inner_steps(AUTO, {}) is None
    assert choose_inner_steps(AUTO, {"a": RoundInfo(step_s=0.2)}) is None  # the first round
    assert choose_inner_steps(AUTO, {"a": RoundInfo(comm_s=1.0)}) is None


def test_the_merge_step_is_the_round_in_the_fastest_steps_plus_a_margin() -> None:
    # b reached the boundary last: its average came 0.15 s later (the round itself); a waited
    # for b too (0.6 s). 0.2 s a step (the fastest): 0.75 steps + 0.5 of margin -> 2
    infos = {"a": RoundInfo(step_s=0.2, arrive_s=0.6), "b": RoundInfo(step_s=0.4, arrive_s=0.15)}
    k, why = choose_merge_steps(infos) or (0, "")
    assert k == 2 and "merge after 2 steps" in why and "0.150 s" in why
    assert choose_merge_steps({"a": RoundInfo(step_s=0.2, arrive_s=0.01)})[0] == 1
    assert choose_merge_steps({"a": RoundInfo(step_s=0.2, arrive_s=2.0)})[0] == 11
    # the step in force stays while the round fits with its margin and at most a step to
    # spare (jitter around a step's boundary does not move it)
    assert choose_merge_steps(infos, current=2) == (2, why.replace("steps", "steps (kept)"))
    assert choose_merge_steps(infos, current=1)[0] == 2  # 0.75 steps: no margin left in 1
    assert choose_merge_steps(infos, current=3)[0] == 2  # 2 to spare: back down
    lower = {"a": RoundInfo(step_s=0.2, arrive_s=0.09)}  # 0.45 steps: 1 wanted, 2 kept
    assert choose_merge_steps(lower)[0] == 1 and choose_merge_steps(lower, current=2)[0] == 2
    assert choose_merge_steps({"a": RoundInfo(step_s=0.2, arrive_s=0.3)}, current=1)[0] == 2
    assert choose_merge_steps({"a": RoundInfo(step_s=0.2)}) is None  # no overlap, or round 0
    assert choose_merge_steps({"a": RoundInfo(arrive_s=1.0)}) is None


def test_decisions_agree_the_merge_step_and_refuse_a_forged_one() -> None:
    coord = Coordinator("a", ["a", "b"], 10.0)
    coord.ready(0, 0, "a", ok=True, numel=8, now=0.0, newest_done=-1,
                info=RoundInfo(step_s=0.2, arrive_s=0.9))
    d = coord.ready(0, 0, "b", ok=True, numel=8, now=0.1, newest_done=-1,
                    info=RoundInfo(step_s=0.2, arrive_s=0.3))
    assert isinstance(d, Decision) and d.next.merge == 2 and d.next.h is None
    assert decode(Decision, encode(d)) == d
    with pytest.raises(MessageError):
        decode(Decision, {**encode(d), "next_merge": 0})
    old = {k: v for k, v in encode(d).items() if k != "next_merge"}  # a relay before it
    assert decode(Decision, old).next.merge is None


def test_round_info_keeps_only_finite_numbers_in_range() -> None:
    info = decode(RoundInfo, {"weight": 0, "step_s": float("nan"), "comm_s": -1.0})
    assert info == RoundInfo()
    assert decode(RoundInfo, {"weight": True, "step_s": "1"}) == RoundInfo()
    assert decode(RoundInfo, "junk") == RoundInfo()
    ok = decode(RoundInfo, {"weight": 512, "step_s": 0.25, "comm_s": 0.0, "other": 1})
    assert ok == RoundInfo(weight=512.0, step_s=0.25, comm_s=0.0) and decode(RoundInfo,
                                                                             encode(ok)) == ok


def test_weights_only_when_every_present_cluster_said() -> None:
    infos = {"a": RoundInfo(weight=2.0), "b": RoundInfo(weight=1.0), "c": RoundInfo()}
    assert round_weights(["a", "b"], infos) == {"a": 2.0, "b": 1.0}
    assert round_weights(["a", "b", "c"], infos) == {}
    assert round_weights(["a", "d"], infos) == {}


# ---------------------------------------------------------------- weighted averages


def test_equal_weights_are_the_plain_mean_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    parts = {c: torch.randn(1000, generator=gen) for c in "cab"}
    plain = ordered_mean(parts)
    assert torch.equal(plain, (parts["a"] + parts["b"] + parts["c"]) / 3)
    assert torch.equal(ordered_mean(parts, weights={c: 7.0 for c in parts}), plain)


def test_weights_make_a_weighted_mean() -> None:
    parts = {"a": torch.full((4,), 3.0), "b": torch.full((4,), 0.0)}
    out = ordered_mean(parts, weights={"a": 2.0, "b": 1.0})
    assert torch.allclose(out, torch.full((4,), 2.0))


def test_decisions_carry_weights_and_next_h_and_refuse_forged_ones() -> None:
    coord = Coordinator("a", ["a", "b"], 10.0, AUTO)
    assert coord.ready(0, 0, "a", ok=True, numel=8, now=0.0, newest_done=-1,
                       info=RoundInfo(weight=256, step_s=0.2, comm_s=2.0)) is None
    d = coord.ready(0, 0, "b", ok=True, numel=8, now=0.1, newest_done=-1,
                    info=RoundInfo(weight=128, step_s=0.1, comm_s=3.0))
    assert isinstance(d, Decision)
    assert dict(d.weights) == {"a": 256.0, "b": 128.0} and d.next.h == 90
    assert "H 90 for 90% utilisation" in d.next.why
    assert decode(Decision, encode(d)) == d
    for forged in ({"weights": {"a": 1.0}}, {"weights": {"a": 1.0, "b": -1.0}},
                   {"weights": {"a": 1.0, "b": float("inf")}}, {"next_h": 0}):
        with pytest.raises(MessageError):
            decode(Decision, {**encode(d), **forged})
    fixed = Coordinator("a", ["a", "b"], 10.0)  # no auto: no H in its decisions
    fixed.ready(0, 0, "a", ok=True, numel=8, now=0.0, newest_done=-1)
    d2 = fixed.ready(0, 0, "b", ok=True, numel=8, now=0.0, newest_done=-1)
    assert isinstance(d2, Decision) and d2.next.h is None and d2.weights == ()


@pytest.mark.parametrize("clusters", [["a", "b"], ["a", "b", "c"]])
def test_relays_average_weighted_by_samples_identically(clusters: list[str]) -> None:
    hub = Hub(clusters, auto_steps=AUTO)
    try:
        gen = torch.Generator().manual_seed(3)
        weights = {"a": 3072.0, "b": 1024.0, "c": 2048.0}
        xs = {c: torch.randn(1000, generator=gen) for c in clusters}

        def call(c: str) -> Any:
            info = RoundInfo(weight=weights[c], step_s=0.1 * (1 + clusters.index(c)),
                             comm_s=0.5)
            return hub.rounds[c].local_round(0, xs[c], info)

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(clusters)) as pool:
            out = {c: f.result(30) for c, f in {c: pool.submit(call, c) for c in clusters}.items()}
        total = sum(weights[c] for c in clusters)
        want = sum(xs[c] * (weights[c] / total) for c in clusters)
        for c in clusters:
            assert out[c].present == clusters
            assert torch.equal(out[c].tensor, out["a"].tensor)  # bit-identical everywhere
            assert torch.allclose(out[c].tensor, want, atol=1e-6)
            assert out[c].weights == {k: weights[k] for k in clusters}
            # the slowest step (0.1 * n) and a 0.5 s round at 90 %: H = ceil(9 * 0.5 / 0.1n)
            assert out[c].next.h == max(5, -(-45 // len(clusters)))
            assert "slowest" in out[c].next.why
        # no info: an equal average, as before
        plain = run_round(hub, 1, xs)
        assert plain["a"].weights == {} and plain["a"].next.h is None
        assert torch.allclose(plain["a"].tensor, sum(xs.values()) / len(xs), atol=1e-6)
    finally:
        hub.close()


# ---------------------------------------------------------------- the worker's round clock


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_rounds_by_steps_report_samples_and_step_time() -> None:
    clock = Clock()
    cad = Cadence(ClusterShare(0, 1, None, 4), inner_steps=10, clock=clock)
    assert not cad.due(9) and cad.due(10)
    clock.t += 5.0
    assert cad.info(10, 32) == {"weight": 320.0, "step_s": 0.5}
    cad.restart(cost=1.5, next_round=NextRound(h=3))  # not auto: H stays
    assert cad.inner_steps == 10 and cad.info(0, 32)["comm_s"] == 1.5


def test_rounds_by_time_come_after_that_much_training() -> None:
    clock = Clock()
    cad = Cadence(ClusterShare(0, 1, None, 4), inner_steps=1, every_s=60.0, clock=clock)
    clock.t += 59.0
    assert not cad.due(100)
    cad.pause(5.0)  # waiting for an overlapped round is not training
    clock.t += 5.5
    assert not cad.due(110)
    clock.t += 0.5
    assert cad.due(111) and not cad.due(0)
    assert cad.info(120, 8)["step_s"] == pytest.approx(60.0 / 120)


def test_auto_takes_the_agreed_h_and_keeps_it_in_checkpoints() -> None:
    cad = Cadence(ClusterShare(0, 1, None, 4), inner_steps=5, auto=True, clock=Clock())
    cad.restart(cost=1.0, next_round=NextRound(h=42))
    assert cad.inner_steps == 42 and cad.due(42) and not cad.due(41)
    cad.follow(NextRound())
    assert cad.inner_steps == 42
    again = Cadence(ClusterShare(0, 1, None, 4), inner_steps=5, auto=True, clock=Clock())
    again.load_state_dict(cad.state_dict())
    assert again.inner_steps == 42


# ---------------------------------------------------------------- the spec and the plan


@pytest.mark.parametrize("text,seconds", [("60s", 60.0), ("2m", 120.0), ("90", 90.0),
                                          ("1.5h", 5400.0), ("250ms", 0.25)])
def test_every_takes_a_duration(tmp_path: Path, text: str, seconds: float) -> None:
    spec = load_spec(write(tmp_path, BASE % f"every: '{text}'"))
    assert spec.relay is not None and spec.relay.sync.every == seconds
    sync = sync_plan.sync_config(spec, "j", spec.clusters[0], "/d", relay_addr="h:1",
                                 checkpoint=None)
    assert sync.every_s == seconds and sync.auto_steps is None


def test_auto_reaches_the_workers_and_the_relays(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, BASE % "inner_steps: auto, target_utilization: 0.9, "
                                            "min_inner_steps: 4, overlap: true"))
    sync = sync_plan.sync_config(spec, "j", spec.clusters[0], "/d", relay_addr="h:1",
                                 checkpoint=None)
    want = AutoSteps(target_utilization=0.9, min_steps=4, max_steps=1000, overlap=True)
    assert sync.inner_steps == 4 and sync.auto_steps == want and sync.every_s is None
    assert relay_plan.auto_steps(spec) == want


@pytest.mark.parametrize("body,field,words", [
    ("every: 60s, inner_steps: 10", "every", "exclude each other"),
    ("every: soon", "every", "not a duration"),
    ("every: 0", "every", "longer than 0"),
    ("inner_steps: sometimes", "inner_steps", ""),
    ("mode: gradient, inner_steps: auto", "inner_steps", "diloco only"),
    ("min_inner_steps: 50, max_inner_steps: 10", "min_inner_steps", "above max_inner_steps"),
    ("target_utilization: 1.0", "target_utilization", ""),
])
def test_bad_cadences_are_refused_at_their_field(tmp_path: Path, body: str, field: str,
                                                 words: str) -> None:
    err = one(tmp_path, BASE % body)
    assert err.field.endswith(field), err.field
    assert words in err.message


# ---------------------------------------------------------------- OuterSync with a cadence


class DecidingAverager(TwoClusterAverager):
    """Records the info of each round and answers with the H a coordinator would choose."""

    def __init__(self, next_h: list[int], next_merge: list[int] | None = None,
                 delay: float = 0.0) -> None:
        super().__init__()
        self.infos: list[dict[str, float]] = []
        self.next_h = next_h
        self.next_merge = next_merge or []
        self.delay = delay

    def allreduce(self, round_id: int, tensor: torch.Tensor, info: Any = None) -> Any:
        self.infos.append(dict(info or {}))
        time.sleep(self.delay)
        res = super().allreduce(round_id, tensor)
        res.next = NextRound(
            h=self.next_h[round_id] if round_id < len(self.next_h) else None,
            merge=self.next_merge[round_id] if round_id < len(self.next_merge) else None)
        return res


def test_auto_outer_sync_trains_the_h_each_result_says() -> None:
    from nebula_cli.config.relay_config import AutoSteps as Auto

    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = DecidingAverager([4, 2])
    cfg = dataclasses.replace(CFG, inner_steps=3, auto_steps=Auto(0.9, 3, 100, False))
    sync = OuterSync(model, config=cfg, averager=averager)
    rounds_at = []
    for step in range(1, 14):
        plain_step(model, opt, step)
        out = sync.after_step(step)
        if out is not None:
            rounds_at.append(step)
            assert out["next_inner_steps"] == averager.next_h[out["outer_round"]] if (
                out["outer_round"] < 2) else "next_inner_steps" not in out
    assert rounds_at == [3, 7, 9, 11, 13]  # H 3 (the first), then 4, then 2 (kept)
    assert [i["weight"] for i in averager.infos] == [3.0, 4.0, 2.0, 2.0, 2.0]  # steps x 1
    assert all(i["step_s"] > 0 for i in averager.infos)
    assert "comm_s" not in averager.infos[0] and averager.infos[1]["comm_s"] >= 0
    assert sync.saved_part()["cadence"] == {"inner_steps": 2, "merge_steps": 1}
    sync.close()


def test_time_based_outer_sync_rounds_after_that_much_training() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = DecidingAverager([])
    sync = OuterSync(model, config=dataclasses.replace(CFG, every_s=0.3), averager=averager)
    t0, rounds = time.monotonic(), 0
    steps = 0
    while time.monotonic() - t0 < 1.5:
        steps += 1
        plain_step(model, opt, steps)
        time.sleep(0.02)
        rounds += sync.after_step(steps) is not None
    assert 3 <= rounds <= 5, rounds  # about every 0.3 s of training, however many steps
    assert sum(i["weight"] for i in averager.infos) <= steps
    assert all(i["weight"] >= 5 for i in averager.infos)  # 0.3 s at >= 0.02 s a step
    sync.close()


def test_step_times_split_steps_with_a_round_in_flight_from_the_others() -> None:
    clock = Clock()
    cad = Cadence(ClusterShare(0, 1, None, 4), inner_steps=10, clock=clock)
    cad.step_done(False)  # before the first mark: not counted
    for dt, in_flight in ((0.2, False), (0.2, False), (0.3, True), (0.5, True)):
        cad.mark()
        clock.t += 1.0 if in_flight else 0.0  # the sync's own work between steps: not counted
        cad.mark()
        clock.t += dt
        cad.step_done(in_flight)
    assert cad.step_times() == pytest.approx({"step_s_idle": 0.2, "step_s_in_flight": 0.4})
    assert cad.step_times() == {}


def test_overlapped_rounds_report_their_timeline() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = OuterSync(model, config=dataclasses.replace(CFG, overlap=True, overlap_steps=2),
                     averager=DecidingAverager([]), inner_steps=3)
    outs = []
    for step in range(1, 10):
        plain_step(model, opt, step)
        time.sleep(0.01)
        outs.append(sync.after_step(step))
    started = [o for o in outs if o and "boundary_s" in o]
    merged = [o for o in outs if o and "wait_s" in o]
    assert len(started) == 3 and len(merged) == 2
    assert all(o["boundary_s"] >= 0 for o in started)
    for o in merged:
        assert o["wait_s"] >= 0 and o["apply_s"] >= 0
        assert o["step_s_in_flight"] >= 0.01 and o["step_s_idle"] >= 0.01
    sync.close()


@pytest.mark.parametrize("delay", [0.0, 0.12])
def test_overlap_merges_at_the_step_the_last_result_agreed(delay: float) -> None:
    """Round 0 is merged 1 step after its boundary (nothing agreed yet); its result agrees 3
    steps for round 1, round 1's 1 for round 2, and later results say nothing (kept): merged
    exactly there, whether the average came sooner (delay 0) or later (0.12 s, about 4 steps:
    waited for); every round after the first tells when its last average arrived."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = DecidingAverager([], next_merge=[3, 1], delay=delay)
    sync = OuterSync(model, config=dataclasses.replace(CFG, overlap=True, overlap_steps=None),
                     averager=averager, inner_steps=6)
    merged = {}
    for step in range(1, 30):
        plain_step(model, opt, step)
        time.sleep(0.03)
        out = sync.after_step(step)
        if out and "merged_after_steps" in out:
            merged[out["outer_round"]] = out["merged_after_steps"]
    assert [merged[r] for r in range(4)] == [1, 3, 1, 1]
    assert sync.saved_part()["cadence"]["merge_steps"] == 1  # resumed with it
    assert "arrive_s" not in averager.infos[0]
    assert all(i["arrive_s"] >= delay for i in averager.infos[1:])
    sync.close()
