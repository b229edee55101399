"""bench/round_memory.py's per-process fits on samples of known growth: the slope and its error
after warm-up, the last half alone, a process too short-lived to say left out."""

from __future__ import annotations

import pytest
from helpers.bench_modules import load_bench


def test_each_process_is_fitted_after_its_warm_up_and_over_its_last_half() -> None:
    m = load_bench("round_memory")
    s = load_bench("_soak_sample")
    samples = []
    for i in range(20):
        rounds = 500 * i
        # the relay grows 0.5 MiB per 1,000 rounds after a warm-up jump; the worker is flat
        # but for alternating noise; a logpump seen twice is too short to say anything
        relay = (100.0 if i < 2 else 150.0) + 0.5 * rounds / 1000
        worker = 300.0 + (0.2 if i % 2 else -0.2)
        per_pid = {"relay": {11: (relay, 9)}, "worker": {12: (worker, 20 + i % 2)}}
        if i >= 18:
            per_pid["logpump"] = {13: (50.0 + i, 3)}
        samples.append(s.Sample(t=i, rounds=rounds, per_pid=per_pid))
    procs = {p["kind"]: p for p in m.per_process(samples, warmup=0.2)}
    assert set(procs) == {"relay", "worker"}
    assert procs["relay"]["rss_growth"] == pytest.approx(0.5, abs=1e-3)
    assert procs["relay"]["stderr"] == pytest.approx(0.0, abs=1e-3)
    assert procs["relay"]["rss_growth_last_half"] == pytest.approx(0.5, abs=1e-3)
    assert abs(procs["worker"]["rss_growth"]) < 0.05 and procs["worker"]["stderr"] > 0
    assert procs["relay"]["rounds"] == [2000, 9500] and procs["relay"]["fd_growth"] == 0.0


def test_the_model_is_chosen_by_name_and_the_quickstarts_is_train_pys_own() -> None:
    m = load_bench("round_memory")
    assert m.parse_args([]).model == "tiny" and "--d-model 32" in m.MODELS["tiny"]
    args = m.parse_args(["--model", "quickstart", "--rounds", "6000", "--sample-every", "3"])
    assert (args.model, args.rounds, args.sample_every) == ("quickstart", 6000, 3.0)
    assert m.MODELS["quickstart"] == ""  # train.py's defaults: the quickstart's GPT
    with pytest.raises(SystemExit):
        m.parse_args(["--model", "huge"])


def test_only_samples_taken_while_workers_ran_are_fitted() -> None:
    m = load_bench("round_memory")
    s = load_bench("_soak_sample")
    samples = [s.Sample(t=i, rounds=r, count={"relay": 2, "worker": w})
               for i, (r, w) in enumerate([(0, 0), (10, 2), (20, 2), (30, 0), (30, 0)])]
    assert [x.rounds for x in m.training(samples)] == [10, 20]
