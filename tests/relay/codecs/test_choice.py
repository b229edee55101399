"""``compression: auto``: the coordinator's choice of codec (pure, with made-up figures), the
agreement that every relay encodes a round with the same codec, error feedback carried across
a change of codec, and relays switching codecs round by round with identical averages."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers.cadence_spec import BASE
from helpers.rounds_hub import Hub
from helpers.specs import write

from nebula_cli.config import sync_plan
from nebula_cli.config.relay_config import AutoCodec, AutoSteps, RelayConfigError
from nebula_cli.config.relay_plan import auto_codec
from nebula_cli.config.spec import load_spec
from nebula_cli.relay.codecs.choice import DENSER_MARGIN, SLACK, CodecCosts, choose_codec
from nebula_cli.relay.codecs.feedback import ErrorFeedback
from nebula_cli.relay.codecs.registry import codecs_of
from nebula_cli.relay.net.schema import decode, encode
from nebula_cli.relay.protocol.agreement import Coordinator, Decision
from nebula_cli.relay.protocol.pacing import RoundInfo
from nebula_cli.relay.protocol.results import RoundOutcome

N = 1 << 20
NBYTES = {name: c.payload_nbytes(N) / N for name, c in codecs_of(["int8", "topk"]).items()}
BY_BYTES = NBYTES["topk"] / NBYTES["int8"]  # about 1/20
FIXED = AutoCodec(codecs=["int8", "topk"], target_utilization=0.9, overlap=False,
                  budget_steps=10, budget_s=None)
AUTO_H = AutoSteps(target_utilization=0.9, min_steps=5, max_steps=200, overlap=False)


def info(step_s: float, comm_s: float | None, codec: str | None) -> dict[str, RoundInfo]:
    return {"a": RoundInfo(step_s=step_s, comm_s=comm_s, codec=codec)}


# ---------------------------------------------------------------- the choice, pure


def test_nothing_is_chosen_before_a_round_was_measured() -> None:
    costs = CodecCosts()
    assert choose_codec(FIXED, None, "int8", info(0.1, None, None), costs, NBYTES) is None
    assert choose_codec(FIXED, None, "int8", {"a": RoundInfo(comm_s=1.0, codec="int8")},
                        costs, NBYTES) is None  # no step time yet
    assert costs.last == ("int8", 1.0)  # but the round's cost is remembered


def test_a_fixed_h_takes_the_most_faithful_codec_that_fits() -> None:
    # 10 steps of 0.1 s at 90 %: a round may cost 10 * 0.1 / 9 = 0.111 s
    fits = choose_codec(FIXED, None, "int8", info(0.1, 0.1, "int8"), CodecCosts(), NBYTES)
    assert fits is not None and fits.codec == "int8" and fits.h is None
    slow = choose_codec(FIXED, None, "int8", info(0.1, 2.0, "int8"), CodecCosts(), NBYTES)
    # topk predicted from the bytes: 2 s / 20 = 0.1 s, which fits
    assert slow is not None and slow.codec == "topk"
    assert "int8 2.000 s" in slow.why and f"topk {2.0 * BY_BYTES:.3f} s" in slow.why
    hopeless = choose_codec(FIXED, None, "int8", info(0.1, 50.0, "int8"), CodecCosts(), NBYTES)
    assert hopeless is not None and hopeless.codec == "topk"  # none fits: the sparsest
    every = AutoCodec(codecs=["int8", "topk"], target_utilization=0.9, overlap=False,
                      budget_steps=None, budget_s=30.0)  # time-based rounds: 30 s of training
    assert choose_codec(every, None, "topk", info(0.1, 2.0, "int8"), CodecCosts(),
                        NBYTES).codec == "int8"  # type: ignore[union-attr]


def test_a_switch_teaches_the_ratio_of_the_codecs_costs() -> None:
    costs = CodecCosts()
    costs.note("int8", 2.0)
    assert costs.predict("topk", NBYTES) == pytest.approx(2.0 * BY_BYTES)  # from the bytes
    costs.note("topk", 0.25)  # the next round, with topk: latency makes it dearer than bytes
    assert costs.ratio[("int8", "topk")] == 8.0 and costs.ratio[("topk", "int8")] == 0.125
    costs.note("topk", 0.5)  # the link halved: int8 predicted from topk's cost and the ratio
    assert costs.predict("int8", NBYTES) == 4.0 and costs.predict("topk", NBYTES) == 0.5


def test_a_more_faithful_codec_must_fit_with_a_margin() -> None:
    costs = CodecCosts(ratio={("int8", "topk"): 10.0, ("topk", "int8"): 0.1})
    # int8 at 0.1 s fits 10 steps of 0.1 s at 90 % (0.111 s) but not with the margin
    costs.last = ("topk", 0.01)
    kept = choose_codec(FIXED, None, "topk", info(0.1, 0.01, "topk"), costs, NBYTES)
    assert kept is not None and kept.codec == "topk"
    assert 0.1 * DENSER_MARGIN > 10 * 0.1 / 9 >= 0.1
    back = choose_codec(FIXED, None, "topk", info(0.1, 0.008, "topk"), costs, NBYTES)
    assert back is not None and back.codec == "int8"  # 0.08 s * 1.25 = 0.1 s: fits
    # already on int8, no margin: 0.1 s fits
    stay = choose_codec(FIXED, None, "int8", info(0.1, 0.1, "int8"), CodecCosts(), NBYTES)
    assert stay is not None and stay.codec == "int8"


def test_auto_h_syncs_as_often_as_allowed_then_as_faithfully() -> None:
    # a fast link: both codecs reach the target at min_inner_steps: the faithful one
    fast = choose_codec(FIXED, AUTO_H, "int8", info(0.1, 0.01, "int8"), CodecCosts(), NBYTES)
    assert fast is not None and (fast.codec, fast.h) == ("int8", 5)
    # int8 needs H 180 (9 * 2 / 0.1), topk H 9: more than SLACK times: topk, with its H
    slow = choose_codec(FIXED, AUTO_H, "int8", info(0.1, 2.0, "int8"), CodecCosts(), NBYTES)
    assert slow is not None and slow.codec == "topk"
    assert slow.h == -(-9 * 2.0 * BY_BYTES // 0.1) and "H" in slow.why
    # within SLACK of the most frequent: int8 is worth its rounds
    costs = CodecCosts(ratio={("int8", "topk"): SLACK, ("topk", "int8"): 1 / SLACK})
    costs.last = ("int8", 1.0)
    near = choose_codec(FIXED, AUTO_H, "int8", info(0.1, 1.0, "int8"), costs, NBYTES)
    assert near is not None and (near.codec, near.h) == ("int8", 90)
    # a link too slow for either within max_inner_steps: the sparsest, at the cap
    cap = choose_codec(FIXED, AUTO_H, "int8", info(0.1, 100.0, "int8"), CodecCosts(), NBYTES)
    assert cap is not None and (cap.codec, cap.h) == ("topk", 200)


# ---------------------------------------------------------------- the agreement


def test_a_round_has_one_codec_and_a_cluster_that_used_another_is_left_out() -> None:
    coord = Coordinator("a", ["a", "b", "c"], 10.0, None, FIXED, NBYTES)
    for c, codec in (("a", "int8"), ("b", "topk")):
        assert coord.ready(3, 0, c, ok=True, numel=8, now=0.0, newest_done=2, codec=(codec, 2),
                           info=RoundInfo(step_s=0.1, comm_s=2.0, codec="int8")) is None
    d = coord.ready(3, 0, "c", ok=True, numel=8, now=0.0, newest_done=2, codec=("int8", 2),
                    info=RoundInfo(step_s=0.1, comm_s=3.0, codec="int8"))
    assert isinstance(d, Decision)
    assert d.codec == "int8" and d.present == ("a", "c") and d.rejected == ("b",)
    assert d.next.codec == "topk" and "topk for 90% utilisation" in d.next.why
    assert decode(Decision, encode(d)) == d
    fixed = Coordinator("a", ["a", "b"], 10.0)  # one codec: nothing to agree on
    fixed.ready(0, 0, "a", ok=True, numel=8, now=0.0, newest_done=-1)
    d2 = fixed.ready(0, 0, "b", ok=True, numel=8, now=0.0, newest_done=-1)
    assert isinstance(d2, Decision) and (d2.codec, d2.next.codec) == ("", "")


# ---------------------------------------------------------------- error feedback


def test_error_feedback_carries_what_one_codec_left_into_the_next() -> None:
    codecs = codecs_of(["int8", "topk"])
    ef = ErrorFeedback(codecs["int8"])
    gen = torch.Generator().manual_seed(5)
    x1, x2 = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    first = codecs["topk"].decode(ef.encode(x1, 0, codecs["topk"]))  # sends about 1/16
    assert float((x1 - first).norm()) > 0.5 * float(x1.norm())
    second = codecs["int8"].decode(ef.encode(x2, 0))  # x2 and all topk left out, in int8
    residual = ef.residual(0)
    assert residual is not None
    assert torch.allclose(first + second + residual, x1 + x2, atol=1e-5)
    assert float(residual.abs().max()) <= float((x1 + x2).abs().max()) / 100  # int8's error


# ---------------------------------------------------------------- relays, round by round


def test_relays_switch_codecs_together_and_average_identically() -> None:
    clusters = ["a", "b", "c"]
    hub = Hub(clusters, codec="auto", auto_codec=FIXED, chunk_numel=1024, block_size=256,
              error_feedback=True)
    gen = torch.Generator().manual_seed(6)
    # (step_s, comm_s) each cluster reports: no cost yet; int8 slow; topk cheap; link faster
    reports = [(0.1, None), (0.1, 2.0), (0.1, 0.2), (0.1, 0.05), (0.1, 0.001), (0.1, 0.1)]
    codecs, outs = [], []
    try:
        for r, (step_s, comm_s) in enumerate(reports):
            xs = {c: torch.randn(5000, generator=gen) for c in clusters}

            def call(c: str, r: int = r, step_s: float = step_s,
                     comm_s: float | None = comm_s, xs: dict = xs) -> RoundOutcome:
                return hub.rounds[c].local_round(r, xs[c], RoundInfo(step_s=step_s,
                                                                     comm_s=comm_s))

            with ThreadPoolExecutor(len(clusters)) as pool:
                out = {c: f.result(30) for c, f in
                       {c: pool.submit(call, c) for c in clusters}.items()}
            for c in clusters:
                assert out[c].present == clusters
                assert torch.equal(out[c].tensor, out["a"].tensor)  # bit-identical
                assert out[c].codec == out["a"].codec
            mean = sum(xs.values()) / len(xs)
            err = float((out["a"].tensor - mean).norm() / mean.norm())
            codecs.append(out["a"].codec)
            outs.append(err)
    finally:
        hub.close()
    # round 1 measured int8's 2 s: topk from round 2; round 4 saw a fast link: int8 again
    assert codecs == ["int8", "int8", "topk", "topk", "topk", "int8"], codecs
    assert outs[0] < 0.02 and outs[2] > 0.5  # int8 is faithful; topk sends 1/16 a round


# ---------------------------------------------------------------- the spec and the plan


def test_the_spec_and_plan_of_compression_auto(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, BASE.replace(
        "sync: {%s}", "compression: auto\n  sync: {inner_steps: 20, outer_momentum: 0.5}")))
    assert spec.relay is not None and spec.relay.compression.codecs == ("int8", "topk")
    assert auto_codec(spec) == AutoCodec(codecs=["int8", "topk"], target_utilization=0.95,
                                         overlap=False, budget_steps=20, budget_s=None)
    sync = sync_plan.sync_config(spec, "j", spec.clusters[0], "/x", relay_addr="h:1",
                                 checkpoint=None)
    # each codec its own outer lr; the momentum the spec names for both
    assert sync.outer_by_codec == {"int8": [0.6, 0.5], "topk": [2.5, 0.5]}
    assert (sync.outer_lr, sync.outer_momentum, sync.codec) == (0.6, 0.5, "auto")
    with pytest.raises(RelayConfigError, match="auto_codec is set exactly when"):
        from helpers.rounds_hub import config
        config("a", ["a", "b"], codec="auto")


def test_a_relay_on_a_stale_codec_is_left_out_and_fetches_the_average() -> None:
    clusters = ["a", "b", "c"]
    hub = Hub(clusters, codec="auto", auto_codec=FIXED, chunk_numel=1024, block_size=256)
    topk = hub.rounds["a"].control.codecs["topk"]
    gen = torch.Generator().manual_seed(7)

    def round_(r: int) -> dict[str, RoundOutcome]:
        xs = {c: torch.randn(3000, generator=gen) for c in clusters}
        with ThreadPoolExecutor(len(clusters)) as pool:
            futs = {c: pool.submit(hub.rounds[c].local_round, r, xs[c]) for c in clusters}
            return {c: f.result(30) for c, f in futs.items()}

    try:
        # b restarted and missed the decisions: it encodes with another codec than a and c
        with hub.rounds["b"].state.lock:
            hub.rounds["b"].control.codec = topk
        out = round_(0)
        assert out["a"].present == ["a", "c"] and out["a"].rejected == ["b"]
        assert out["b"].mode == "fetched" and out["b"].codec == "int8" == out["a"].codec
        assert all(torch.equal(out[c].tensor, out["a"].tensor) for c in clusters)
        assert hub.rounds["b"].state.lineage == hub.rounds["a"].state.lineage
        assert round_(1)["b"].present == clusters  # b follows the decision from then on
        # a relay that knows the newest decision wins a tie over one that restarted
        with hub.rounds["a"].state.lock, hub.rounds["c"].state.lock:
            for c in ("a", "c"):
                hub.rounds[c].control.codec, hub.rounds[c].control.codec_round = topk, 1
        with hub.rounds["b"].state.lock:
            hub.rounds["b"].control.codec_round = -1
        out = round_(2)
        assert out["a"].codec == "topk" and out["a"].rejected == ["b"]
        assert out["b"].codec == "topk" and torch.equal(out["b"].tensor, out["a"].tensor)
    finally:
        hub.close()
