"""The benchmarks (bench/wan_training.py, relay_goodput.py, chaos.py, hetero.py, adaptive.py)
without running them: their --help works, and the JSON they print last has the field names the
issue asks for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.bench_modules import load_bench as load
from helpers.jobs import REPO

SCRIPTS = {
    "soak": ("rounds", "rss_growth_mb_per_1000_rounds", "fd_growth_per_1000_rounds",
             "disk_bytes_end", "disk_bound_bytes", "status_time_ratio", "goodput_vs_clean",
             "identical", "left_processes", "goals_met"),
    "chaos": ("goodput_vs_clean", "faults_injected", "lost_steps", "params_identical",
              "eval_loss_clean", "eval_loss_faults"),
    "wan_training": ("speedup_vs_flat", "utilization", "utilization_overlap", "loss_gap",
                     "wan_bytes_reduction", "link_mbit", "rtt_ms"),
    "relay_goodput": ("goodput_vs_iperf3", "tls_vs_plain", "link_mbit", "clusters"),
    "hetero": ("fast_cluster_utilization", "fast_cluster_utilization_fixed_h", "loss_gap",
               "loss_gap_fixed_h", "slowdown"),
    "adaptive": ("utilization_after_cut", "utilization_after_cut_fixed_h", "h_trace",
                 "utilization_after_cut_auto_codec", "codec_trace"),
    "round_memory": ("rounds", "rss_growth_mb_per_1000_rounds", "rss_growth_stderr",
                     "fd_growth_per_1000_rounds", "rounds_per_s", "left_processes", "goals_met"),
    "outer_state": ("runs", "max_rank_copies_of_shard", "max_rank0_copies_of_whole",
                    "goals_met"),
    "scale": ("sizes", "max_outer_memory_vs_shard", "round_time_vs_bound_1g",
              "round_time_vs_bound_10g", "largest_params", "identical", "goals_met"),
    "relay_loopback": ("end_to_end_vs_tcp", "tls_vs_tcp", "end_to_end_tls_vs_tcp",
                       "wan_hop_vs_tcp", "duplex_vs_tcp", "records_duplex_vs_tcp", "stages"),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_runs_without_a_bed(name: str) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / f"{name}.py"), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "--json" in proc.stdout and "--quick" in proc.stdout
    assert "--side" not in proc.stdout  # the internal sides stay hidden


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_json_fields_are_declared(name: str) -> None:
    assert SCRIPTS[name] == load(name).JSON_FIELDS


def test_wan_training_summary_has_the_fields_and_ratios() -> None:
    mod = load("wan_training")

    def run(name: str, s_per_step: float, loss: float, wan: int | None) -> object:
        tokens = 100 * 2048
        return mod.Run(name=name, steps=100, tokens=tokens, s_per_step=s_per_step,
                       tokens_per_s=2048 / s_per_step, eval_loss=loss, wan_bytes=wan,
                       relay_bytes=None if name == "flat" else 1000, identical=True, wall_s=1.0)

    runs = {"flat": run("flat", 5.0, 2.0, 2_000_000_000), "nebula": run("nebula", 0.4, 2.04,
                                                                          10_000_000),
            "overlap": run("overlap", 0.35, 2.05, 10_000_000),
            "unshaped": run("unshaped", 0.36, 2.04, None)}
    out = mod.summarize(runs, link_mbit=20.0, rtt_ms=50.1)
    assert tuple(out)[: len(SCRIPTS["wan_training"])] == SCRIPTS["wan_training"]
    assert out["speedup_vs_flat"] == pytest.approx(12.5)
    assert out["utilization"] == pytest.approx(0.9, abs=1e-4)
    assert out["loss_gap"] == pytest.approx(0.02)
    assert out["wan_bytes_reduction"] == pytest.approx(200.0)
    assert out["loss_gap_overlap"] == pytest.approx(0.025)
    assert out["goals_met"] == {"speedup_vs_flat": True, "utilization": True,
                                "utilization_overlap": True, "loss_gap": True,
                                "loss_gap_overlap": True, "wan_bytes_reduction": False}
    # further seeds: loss gap and bytes reduction are the median over all seeds
    extra = {1: {"flat": run("flat", 0.5, 2.2, 2_000_000_000),
                 "nebula": run("nebula", 0.4, 2.2 * 1.05, 1_000_000)},
             2: {"flat": run("flat", 0.5, 2.1, 2_000_000_000),
                 "nebula": run("nebula", 0.4, 2.1 * 1.01, 4_000_000)}}
    out = mod.summarize(runs, link_mbit=20.0, rtt_ms=50.1, first_seed=1234, extra=extra)
    assert [f["seed"] for f in out["per_seed"]] == [1234, 1, 2]
    assert [f["loss_gap"] for f in out["per_seed"]] == pytest.approx([0.02, 0.05, 0.01])
    assert out["loss_gap"] == pytest.approx(0.02)
    assert out["wan_bytes_reduction"] == pytest.approx(500.0)  # of 200, 2000, 500
    assert out["goals_met"]["loss_gap"] and not out["goals_met"]["wan_bytes_reduction"]
    # repetitions: the loss gap with overlap of every run, the goal judged on the worst
    again = {1: {"nebula": run("nebula", 0.4, 2.04, 10_000_000),
                 "unshaped": run("unshaped", 0.36, 2.04, None),
                 "overlap": run("overlap", 0.35, 2.08, 10_000_000)}}
    mod.spread(out, runs, again)
    assert out["loss_gap_overlap_runs"] == pytest.approx([0.025, 0.04])
    assert out["loss_gap_overlap_spread"]["max"] == pytest.approx(0.04)
    assert not out["goals_met"]["loss_gap_overlap"]
    assert out["utilization_overlap_runs"] == pytest.approx([0.35 ** -1 * 0.36] * 2, abs=1e-3)
    args = mod.parse_args(["--inner-steps", "25", "--codec", "int8"])
    predicted = mod.advisor_prediction(runs, args, rtt_ms=50.1)
    # the advisor's own model: H t / (H t + bytes * 8 / rate + 3 rtt), t from (c)
    wan = predicted["params"] * (1 + 4 / 256) * 8 / 20e6 + 3 * 0.0501
    assert predicted["utilization"] == pytest.approx(25 * 0.36 / (25 * 0.36 + wan))
    out = mod.summarize(runs, link_mbit=20.0, rtt_ms=50.1, predicted=predicted)
    assert out["advisor_error"] == pytest.approx(abs(0.9 - predicted["utilization"]), abs=2e-4)
    assert out["goals_met"]["advisor_error"] == (out["advisor_error"] <= 0.05)


def test_relay_goodput_summary_has_the_fields_and_ratios() -> None:
    mod = load("relay_goodput")
    out = mod.summarize({"iperf3": 19.0, "plain": 18.5, "tls": 18.4}, 20.0,
                        [{"iperf3_bidir": 18.0, "relay": 17.1},
                         {"iperf3_bidir": 18.0, "relay": 16.0},
                         {"iperf3_bidir": 17.0, "relay": 16.5}])
    assert tuple(out)[: len(SCRIPTS["relay_goodput"])] == SCRIPTS["relay_goodput"]
    assert out["goodput_vs_iperf3_runs"] == pytest.approx([0.95, 16 / 18, 16.5 / 17], abs=1e-4)
    assert out["goodput_vs_iperf3"] == pytest.approx(16 / 18, abs=1e-4)  # the lowest run
    assert out["goodput_vs_iperf3_spread"]["median"] == pytest.approx(0.95)
    assert out["tls_vs_plain"] == pytest.approx(17.1 / 18.5, abs=1e-4)
    assert out["goals_met"] == {"goodput_vs_iperf3": False}


def test_relay_goodput_round_bound_is_the_busiest_relay_at_the_line_rate() -> None:
    """--clusters N: the bound of a round is the larger of what the busiest relay sent and
    received at the line's rate; the JSON's round_vs_bound is the worst shard-mode codec."""
    mod = load("relay_goodput")  # puts bench/ on sys.path, as the script does
    relays = load("_relays")
    mb = 1e6 / 8  # bytes per Mbit

    def done(end: float, sent: float, received: float) -> dict[str, float]:
        return {"end": end, "bytes_sent": sent, "bytes_received": received, "relay_s": 1.0,
                "error": 0.0, "transport": "local"}

    run = {"encoded_bytes": 20 * mb, "rounds": [
        {"start": 100.0, "done": {"a": done(103.0, 30 * mb, 29 * mb),
                                  "b": done(102.0, 29 * mb, 31 * mb)}},
        {"start": 200.0, "done": {"a": done(204.0, 30 * mb, 30 * mb),
                                  "b": done(203.5, 30 * mb, 30 * mb)}}]}
    fig = relays.round_figures(run, rate_mbit=10.0, clusters=4)
    assert [r["bound_s"] for r in fig["rounds"]] == pytest.approx([3.1, 3.0])
    assert fig["round_vs_bound"] == pytest.approx(7.0 / 6.1)
    assert fig["round_vs_bound_max"] == pytest.approx(4.0 / 3.0)
    assert fig["busiest_vs_encoded"] == pytest.approx(30.5 / 20)
    args = mod.parse_args(["--clusters", "4"])
    fig.update(tcp_s=6.5, tcp_vs_bound=1.1, round_vs_tcp=3.5 / 6.5, mode="shard")
    worse = {**fig, "round_vs_bound": 1.3}
    out = load("_clusters").summarize({"none": fig, "int8": worse,
                                       "topk": {**fig, "round_vs_bound": 3.0,
                                                "mode": "all-to-all"}}, args)
    assert tuple(out)[:5] == load("_clusters").JSON_FIELDS and out["clusters"] == 4
    assert out["params_identical"] is None  # no training job in this summary
    job = {"job_state": "SUCCEEDED", "params_identical": True, "workers_final": 4}
    trained = load("_clusters").summarize({"int8": worse, "_train": job}, args)
    assert trained["params_identical"] is True and trained["training"] == job
    assert trained["goals_met"] == {"round_vs_bound": False, "trained": True}
    assert out["round_vs_bound"] == 1.3 and out["round_vs_bound_all_to_all"] == 3.0
    assert out["goals_met"] == {"round_vs_bound": False}
    assert "one line per cluster" in out["topology"] and out["tcp"] == "reno"
    assert out["tcp_vs_bound"] == 1.1


@pytest.mark.parametrize("per_cluster", [2, 1])
def test_diloco_schedule_runs_every_mode(capsys: pytest.CaptureFixture[str],
                                         per_cluster: int) -> None:
    """bench/diloco_schedule.py end to end on a tiny schedule: every mode ends with the
    clusters identical, the JSON carries each run's gap to flat."""
    mod = load("diloco_schedule")
    assert mod.main(["--steps", "4", "--inner-steps", "2", "--settings", "1.0,0", "0.6,0.5",
                     "--modes", "sync", "overlap", "late", "--tau", "1",
                     "--workers-per-cluster", str(per_cluster), "--micro-batch", "2",
                     "--json"]) == 0
    printed = capsys.readouterr().out
    assert f"{per_cluster} worker(s) per cluster of 2 x 128 tokens" in printed
    out = json.loads(printed.strip().splitlines()[-1])
    assert tuple(out)[:4] == mod.JSON_FIELDS
    assert [(r["mode"], r["outer_lr"]) for r in out["runs"]] == [
        ("sync", 1.0), ("sync", 0.6), ("overlap", 1.0), ("overlap", 0.6), ("late", 1.0),
        ("late", 0.6)]
    for r in out["runs"]:
        assert r["identical"]
        assert r["gap"] == pytest.approx((r["eval"] - r["flat_eval"]) / r["flat_eval"],
                                         abs=2e-4)
        assert r["bytes_per_token_reduction"] > 1
    assert out["loss_gap"] == out["medians"][0]["loss_gap"] == out["runs"][0]["gap"]


def test_diloco_schedule_compares_error_feedback_decays(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--decays runs each setting once per decay beta (compression.feedback_decay), at equal
    bytes, each with its own median."""
    mod = load("diloco_schedule")
    assert mod.main(["--steps", "6", "--inner-steps", "2", "--codec", "topk", "--modes", "sync",
                     "--decays", "1,0.5", "--micro-batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["feedback_decay"] for r in out["runs"]] == [1.0, 0.5]
    assert [m["feedback_decay"] for m in out["medians"]] == [1.0, 0.5]
    assert out["runs"][0]["eval"] != out["runs"][1]["eval"]  # the decay changed the rounds
    assert (out["runs"][0]["bytes_per_token_reduction"]
            == out["runs"][1]["bytes_per_token_reduction"])
    assert out["settings"]["decays"] == [1.0, 0.5]
    with pytest.raises(SystemExit):
        mod.parse_args(["--decays", "0"])
    with pytest.raises(SystemExit):  # a span is topk's
        mod.parse_args(["--codec", "int8", "--span", "4096"])
    assert mod.parse_args(["--codec", "topk"]).decay_list == [0.7]  # the codec's own
    assert mod.parse_args(["--codec", "int8"]).decay_list == [1.0]


def test_relay_loopback_runs_and_prints_every_ratio_and_stage() -> None:
    """A tiny real run (8 MB, one round each way): the ratios come from that run, the stages
    are printed side by side, the worker on the relays' host went through their sockets."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "relay_loopback.py"), "--mb", "8",
                           "--repeat", "1", "--json"], capture_output=True, text=True,
                          timeout=600, cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    summary = json.loads(out.strip().splitlines()[-1])
    for key in SCRIPTS["relay_loopback"][:-1]:
        assert 0 < summary[key] < 5, (key, summary[key])
    assert set(summary["stages"]) == {"local", "tls"}
    assert summary["stages"]["local"]["upload"][0] < summary["stages"]["tls"]["upload"][0]
    assert "relay's round (agree, exchange)" in out and "worker over TLS" in out


def test_hetero_takes_the_codec_schedule_unless_told() -> None:
    mod = load("hetero")
    h, lr, momentum = load("_schedules").schedule("int8")
    args = mod.parse_args(["--codec", "int8"])
    assert (args.inner_steps, args.outer_lr, args.outer_momentum) == (h, lr, momentum)
    args = mod.parse_args(["--codec", "int8", "--inner-steps", "10", "--outer-lr", "0.5",
                           "--outer-momentum", "0"])
    assert (args.inner_steps, args.outer_lr, args.outer_momentum) == (10, 0.5, 0.0)
