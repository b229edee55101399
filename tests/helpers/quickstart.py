"""The quickstart's short spec and what a finished job must show (`check_finished_job`), its metric
records and its relays' logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from helpers.jobs import CLI, REPO, job_processes

# examples/gpt's options for a test's model: ~0.1 s a step with four workers on two cores
# (118,528 parameters, 32-token context) against ~1.9 s for the quickstart's 1.3 M at 128 tokens
TINY_GPT = "--context 32 --d-model 64 --n-layer 2"
# the quickstart's 1.3 M parameters (what travels in a round) at a quarter of its tokens a step
SHORT_CONTEXT = "--context 32"


def short_spec(tmp_path: Path, *, clusters: dict[str, list[str]], steps: int, inner: int,
               name: str = "quick", overlap: bool = False, model: str = TINY_GPT) -> Path:
    spec = yaml.safe_load((REPO / "templates" / "quickstart.yaml").read_text())
    spec["name"] = name
    spec["workdir"] = str(REPO / "examples" / "gpt")
    steps_option = f"--steps {steps} " if steps else ""  # 0: $NEBULA_STEPS, per cluster
    spec["run"] = f"python -u train.py {steps_option}--eval-every {inner} --log-every 5 {model}"
    spec["clusters"] = [
        {"name": c, "transport": "local", "hosts": [{"host": h} for h in hosts]}
        for c, hosts in clusters.items()
    ]
    spec["relay"]["sync"]["inner_steps"] = inner
    spec["relay"]["sync"]["overlap"] = overlap
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def metric_records(home: Path, job_id: str) -> list[dict[str, Any]]:
    records = []
    for path in sorted((home / "jobs" / job_id).glob("*/*/worker/metrics/*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


def relay_logs(root: Path) -> dict[str, str]:
    """cluster -> its relay's log, under a job's directory."""
    return {p.parts[-5]: p.read_text() for p in sorted(root.glob("*/*/relay/logs/relay.log"))}


def check_finished_job(cli: CLI, job_id: str, workers: int, rounds: int) -> None:
    logs = relay_logs(cli.home / "jobs" / job_id)  # rank 0 runs on the relay's host: no TLS
    assert logs and all("connected through the local socket" in t for t in logs.values())
    assert not any("connected through mutual TLS" in t for t in logs.values())
    records = metric_records(cli.home, job_id)
    finals = [r for r in records if r.get("final")]
    assert len(finals) == workers
    assert len({r["param_sha256"] for r in finals}) == 1, "workers ended with different weights"
    first = [r["loss"] for r in records if "loss" in r]
    assert first and finals[0]["eval_loss"] < first[0] - 0.5, "the loss did not fall"
    synced = [r for r in records if r.get("outer_round") is not None and "round_s" in r
              and r.get("applied", True)]  # overlap: a round just started is applied later
    assert max(r["outer_round"] for r in synced) + 1 >= rounds
    assert all(r["clusters_present"] >= 2 for r in synced)
    assert all(r["wan_bytes_sent"] > 0 for r in synced)
    st = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED"
    assert {h["state"] for h in st["hosts"] if h["role"] == "worker"} == {"SUCCEEDED"}
    assert {h["state"] for h in st["hosts"] if h["role"] == "relay"} <= {"STOPPED", "SUCCEEDED"}
    assert job_processes(job_id) == []
    stop = cli("stop", job_id, check=True)
    assert "already ended" in stop.stdout and job_processes(job_id) == []
