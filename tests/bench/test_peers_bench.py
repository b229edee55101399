"""bench/peers.py without a bed: its --help, its arguments, the figures it computes from records
(time to target, bytes per token, the ratios against the best peer, an error row), the
nftables rules of its delaying proxy; and scripts/gpu-check.sh: --help always, the --dry-run
on this CPU (nebula launch of two small jobs: marked slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers.bench_modules import BENCH
from helpers.bench_modules import load_bench as load
from helpers.jobs import REPO


def test_help_runs_without_a_bed() -> None:
    proc = subprocess.run([sys.executable, str(BENCH / "peers.py"), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    for word in ("--quick", "--json", "torchft", "hivemind", "nebula-topk", "delay"):
        assert word in proc.stdout


def test_arguments_quick_and_the_checks() -> None:
    peers = load("peers")
    args = peers.parse_args(["--quick"])
    assert args.seed_list == [1234] and args.steps == 40 and args.dense_h == 20
    assert args.steps % args.topk_h == 0
    full = peers.parse_args([])
    assert full.seed_list == [1234, 1, 2] and full.steps == 200
    assert peers.nebula_relay(full, "int8")["sync"]["outer_lr"] == full.outer_lr
    assert peers.nebula_relay(full, "auto")["sync"] == {"mode": "diloco",
                                                        "inner_steps": full.topk_h}
    for bad in (["--steps", "45"], ["--systems", "torchft"], ["--systems", "flat,nope"]):
        with pytest.raises(SystemExit):
            peers.parse_args(bad)


def job(name: str, *, evals: list[tuple[int, float, float]], final: float, wan: int,
        workers: int = 4, sha: str = "a", s_step: float = 0.5) -> object:
    """A Job whose workers' records hold `evals` (step, eval loss, seconds after step 1)."""
    jobs = load("_peers_jobs")
    records = []
    for w in range(workers):
        records.append({"ts": 100.0 + w * 0.1, "step": 1, "loss": 5.0, "rank": w})
        records += [{"ts": 100.0 + t, "step": s, "eval_loss": loss, "rank": w}
                    for s, loss, t in evals]
        records.append({"ts": 200.0, "step": 40, "final": True, "eval_loss": final, "rank": w,
                        "param_sha256": sha if w else "a", "s_per_step": s_step + w * 0.01})
    return jobs.Job(name, records, wan, 60.0, 4 * 4 * 128, 40, workers)


def test_rows_and_ratios_against_the_best_peer() -> None:
    fig = load("_peers_figures")
    flat = fig.row(job("flat", evals=[(40, 2.0, 300.0)], final=2.0, wan=10**9), 1, None)
    target = fig.target_of(flat)
    assert target == pytest.approx(2.06)
    curve = [(20, 2.5, 10.0), (40, 2.05, 20.0)]
    torchft = fig.row(job("torchft", evals=curve, final=2.05, wan=80_000_000), 1, target)
    assert torchft.time_to_target_s == 20.0  # the first evaluation at or below 2.06
    assert torchft.wan_bytes_per_token == pytest.approx(80_000_000 / (40 * 2048), abs=0.01)
    assert torchft.tokens_per_s == pytest.approx(2048 / 0.53, abs=0.1)  # the slowest worker
    assert torchft.identical is True
    slow = fig.row(job("hivemind", evals=[(40, 2.2, 30.0)], final=2.2, wan=40_000_000,
                       sha="b"), 1, target)
    assert slow.time_to_target_s is None and slow.identical is False
    ours = fig.row(job("nebula-int8", evals=[(20, 2.06, 5.0)], final=2.03,
                       wan=4_000_000), 1, target)
    topk = fig.row(job("nebula-topk", evals=[(20, 2.3, 4.0), (40, 2.04, 8.0)],
                       final=2.04, wan=1_000_000), 1, target)
    missing = fig.row(job("nebula-auto", evals=[], final=2.0, wan=1, workers=3), 1, target)
    assert missing.error is None  # three workers, three finals: a row
    broken = fig.Row("nebula-auto", 1, error="RuntimeError: it broke")
    out = fig.summarize([flat, torchft, slow, ours, topk, broken], [1], {"quick": True})
    assert tuple(out)[: len(fig.JSON_FIELDS)] == fig.JSON_FIELDS
    assert out["time_to_target_vs_best_peer"] == pytest.approx(5.0 / 20.0)
    assert out["per_seed"]["1"]["time_to_target_vs_best_peer"]["nebula"] == "nebula-int8"
    # bytes: topk's against hivemind's (the fewer of the peers), loss: int8's against torchft's
    assert out["bytes_vs_best_peer"] == pytest.approx(1_000_000 / 40_000_000)
    assert out["loss_at_equal_tokens_vs_best_peer"] == pytest.approx(2.03 / 2.05, abs=1e-4)
    assert out["goals_met"] == {"time_to_target_vs_best_peer": True, "bytes_vs_best_peer": True,
                                "loss_at_equal_tokens_vs_best_peer": True}
    assert {"system": "nebula-auto", "seed": 1, "error": "RuntimeError: it broke"} in out["rows"]
    assert out["targets"] == {"1": pytest.approx(2.06)}
    lost = fig.summarize([flat, torchft], [1], {})
    assert lost["time_to_target_vs_best_peer"] is None and not any(lost["goals_met"].values())


def test_an_unfinished_job_is_an_error_row() -> None:
    fig = load("_peers_figures")
    j = job("torchft", evals=[(20, 2.5, 10.0)], final=2.1, wan=1)
    j.records = [r for r in j.records if not (r.get("final") and r["rank"] == 3)]
    r = fig.row(j, 1, 2.0)
    assert r.error == "3 final records of 4 workers"


def test_the_proxy_redirects_every_pair_of_clusters() -> None:
    delay = load("_peers_delay")
    bed = SimpleNamespace(clusters={"east": ["e1"], "west": ["w1"], "north": ["n1"]},
                          hosts_of=lambda c: [SimpleNamespace(address={
                              "east": "198.18.0.1", "west": "198.18.1.1",
                              "north": "198.18.2.1"}[c])])
    text = delay.rules(bed, 39999)
    assert text.count("dnat to") == 6  # every ordered pair
    assert ("ip saddr 198.18.0.0/24 ip daddr 198.18.1.0/24 meta l4proto tcp "
            "dnat to 198.18.0.254:39999") in text
    assert "198.18.2.0/24 ip daddr 198.18.2.0/24" not in text  # inside a cluster: direct


def test_gpu_check_help() -> None:
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--help"],
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "--dry-run" in proc.stdout and "NCCL" in proc.stdout
    bad = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--nope"],
                         capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and "unknown option --nope" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_gpu_check_dry_run_on_the_cpu() -> None:
    """The whole check on this CPU: two small nebula jobs (gloo) and the codecs. A check that
    runs over its time is ended through its own cleanup (every job it started stopped)."""
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--dry-run",
                             "--steps", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=240)
        pytest.fail(f"gpu-check --dry-run still running after 1200 s:\n{stderr[-3000:]}")
    out = json.loads(stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (out, stderr[-3000:])
    assert out["device"] == "cpu" and out["dry_run"] and out["ok"] and not out["errors"]
    assert out["parts"]["quickstart"]["identical"] is True
    assert out["parts"]["quickstart"]["relay_round_s"]["rounds"] >= 1
    assert out["parts"]["hook"]["state"] == "SUCCEEDED"
    assert out["parts"]["hook"]["processes_left"] == 0
    assert out["parts"]["codecs"]["results"]["int8/cpu"]["encode_gbs"] > 0
    for labels in ("topk", "sampled"):  # examples/distill under nebula launch, both label kinds
        part = out["parts"]["distill"][labels]
        assert part["state"] == "SUCCEEDED" and part["without_labels"] == 0, part
        assert part["final"].endswith("on cpu"), part
    assert (out["parts"]["distill"]["sampled"]["bytes_per_token"]
            < out["parts"]["distill"]["topk"]["bytes_per_token"] / 4)
