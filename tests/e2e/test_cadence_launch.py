"""Cadences end to end, through the real CLI, relays and DeepSpeed: time-based rounds with one
cluster twice as slow (weighted by samples, nobody waits), and ``inner_steps: auto`` (every
cluster trains the H the relays agreed on)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.jobs import CLI
from helpers.quickstart import SHORT_CONTEXT, check_finished_job, metric_records, short_spec

pytestmark = pytest.mark.slow


def relay_rounds(cli: CLI, job_id: str, cluster: str) -> list[dict[str, Any]]:
    (path,) = (cli.home / "jobs" / job_id).glob(f"{cluster}/*/relay/metrics/relay.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def launch(cli: CLI, spec_path: Path, edit: dict[str, Any],
           env: dict[str, dict[str, str]] | None = None) -> str:
    """Launch with `edit` in relay.sync and each cluster's `env` (where it names NEBULA_STEPS,
    the cluster's own number of steps: the spec from `short_spec(steps=0)`); wait for the
    end."""
    spec = yaml.safe_load(spec_path.read_text())
    spec["relay"]["sync"].pop("inner_steps")
    spec["relay"]["sync"].update(edit)
    for cluster in spec["clusters"]:
        cluster["env"] = (env or {}).get(cluster["name"], {})
    spec_path.write_text(yaml.safe_dump(spec))
    job_id = cli("launch", str(spec_path), "--detach", check=True).stdout.strip()
    assert cli("logs", job_id, "-f", timeout=900).returncode == 0
    return job_id


def test_time_based_rounds_weight_a_slower_cluster_by_its_samples(cli: CLI,
                                                                  tmp_path: Path) -> None:
    spec_path = short_spec(tmp_path, clusters={"fast": ["f1"], "slow": ["s1"]}, steps=0,
                           inner=10, name="every", model=SHORT_CONTEXT)
    # the slow cluster takes 2.5 times as long a step: as long for 20 steps as fast for 50.
    # A round every second: an idle machine trains all this in ~5 s (every 2 s made only two
    # joint rounds there)
    job_id = launch(cli, spec_path, {"every": "1s"}, {
        "fast": {"NEBULA_STEPS": "50"}, "slow": {"NEBULA_STEPS": "20", "GPT_SLOWDOWN": "2.5"}})
    records = metric_records(cli.home, job_id)
    finals = {r["cluster"]: r for r in records if r.get("final")}
    assert finals["fast"]["step"] == 50 and finals["slow"]["step"] == 20
    assert finals["fast"]["param_sha256"] == finals["slow"]["param_sha256"]
    joint = [r for r in relay_rounds(cli, job_id, "fast") if len(r["present"]) == 2]
    assert len(joint) >= 3
    fast, slow = (sum(r["weights"][c] for r in joint) for c in ("fast", "slow"))
    assert fast > 1.5 * slow, joint  # the fast cluster trained on more samples, same time
    assert [r["weights"] for r in joint] == [
        r["weights"] for r in relay_rounds(cli, job_id, "slow") if len(r["present"]) == 2]
    log = next((cli.home / "jobs" / job_id).glob("fast/*/relay/logs/relay.log")).read_text()
    assert "weighted by samples" in log
    st = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED"


def test_auto_inner_steps_are_agreed_by_every_cluster(cli: CLI, tmp_path: Path) -> None:
    spec_path = short_spec(tmp_path, clusters={"east": ["e1"], "west": ["w1"]}, steps=36,
                           inner=10, name="auto")
    job_id = launch(cli, spec_path, {"inner_steps": "auto", "min_inner_steps": 3,
                                     "max_inner_steps": 12, "target_utilization": 0.9})
    check_finished_job(cli, job_id, workers=2, rounds=3)
    chosen = {c: {r["round"]: r["next_h"] for r in relay_rounds(cli, job_id, c)
                  if len(r["present"]) == 2} for c in ("east", "west")}
    assert chosen["east"] == chosen["west"] and len(chosen["east"]) >= 2
    assert all(3 <= h <= 12 for h in list(chosen["east"].values())[1:])
    # each cluster's rounds came after the H the previous round's result said
    for cluster in ("east", "west"):
        steps = {r["outer_round"]: (r["step"], r.get("next_inner_steps"))
                 for r in metric_records(cli.home, job_id)
                 if r.get("cluster") == cluster and r.get("outer_round") is not None
                 and not r.get("final_round")}
        assert steps[0][0] == 3  # the first round: min_inner_steps
        for r in sorted(steps)[1:]:
            if r - 1 in steps and steps[r - 1][1] is not None:
                assert steps[r][0] - steps[r - 1][0] == steps[r - 1][1], (cluster, steps)


def test_auto_compression_switches_codec_in_every_cluster_at_once(cli: CLI,
                                                                   tmp_path: Path) -> None:
    """``compression: auto`` on a slow emulated link: the first rounds in int8 measure it, the
    relays agree on topk from then on, each worker applies each round with its codec's outer
    settings, and the clusters end identical."""
    spec_path = short_spec(tmp_path, clusters={"east": ["e1"], "west": ["w1"]}, steps=60,
                           inner=10, name="autocodec")
    spec = yaml.safe_load(spec_path.read_text())
    spec["relay"]["compression"] = "auto"
    for name in ("outer_lr", "outer_momentum"):  # each codec's own
        spec["relay"]["sync"].pop(name)
    spec["relay"]["shaping"] = {"rate_mbit": 20, "delay_ms": 25}
    spec_path.write_text(yaml.safe_dump(spec))
    job_id = launch(cli, spec_path, {"inner_steps": "auto", "min_inner_steps": 3,
                                     "max_inner_steps": 12, "target_utilization": 0.95})
    check_finished_job(cli, job_id, workers=2, rounds=4)
    rounds = {c: {r["round"]: r for r in relay_rounds(cli, job_id, c)
                  if len(r["present"]) == 2} for c in ("east", "west")}
    codecs = {c: {k: r["codec"] for k, r in v.items()} for c, v in rounds.items()}
    assert codecs["east"] == codecs["west"], codecs
    first, *rest = [codecs["east"][k] for k in sorted(codecs["east"])]
    # int8 (1.3 MB a round at 20 Mbit/s) cannot reach 95 % within 12 steps; topk can
    assert first == "int8" and rest and rest[-1] == "topk", codecs
    switch = next(r for r in rounds["east"].values() if r["next_codec"] == "topk")
    assert "topk for 95% utilisation" in switch["next_h_why"]
    log = next((cli.home / "jobs" / job_id).glob("east/*/relay/logs/relay.log")).read_text()
    assert "codec topk (topk for 95% utilisation" in log
    applied = {(r["cluster"], r["outer_round"]): r.get("codec")
               for r in metric_records(cli.home, job_id)
               if r.get("outer_round") is not None and "round_s" in r}
    assert {codec for codec in applied.values()} == {"int8", "topk"}, applied
