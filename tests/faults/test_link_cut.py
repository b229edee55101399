"""A cut WAN link (test bed, root): for as long as the link between the clusters is down, each
side takes the other for dead and trains on alone; when it heals they rejoin without any
restart, heal their diverged states (the lineage rule) and end with identical parameters."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.jobs import CLI, REMOTE_JOBS, REPO, job_processes, wait_for
from helpers.quickstart import SHORT_CONTEXT
from testbed import TestBed

pytestmark = [pytest.mark.testbed, pytest.mark.slow]


def rounds(job_id: str, cluster: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted((REMOTE_JOBS / job_id).glob(f"{cluster}/*/worker/metrics/*.jsonl")):
        for line in path.read_text().splitlines():
            if line:
                rec = json.loads(line)
                if rec.get("outer_round") is not None and "clusters_present" in rec:
                    out.append(rec)
    return out


def test_a_cut_link_is_a_dead_peer_on_each_side_and_heals_without_a_restart(
        ssh_cli: CLI, bed_clean: TestBed, tmp_path: Path) -> None:
    spec = {
        "name": "cut", "workdir": str(REPO / "examples" / "gpt"),
        "run": f"python -u train.py --steps 150 --eval-every 150 --log-every 10 {SHORT_CONTEXT}",
        "deepspeed": "ds_config.json", "env": {"OMP_NUM_THREADS": "1"},
        "clusters": [{"name": c, "transport": "ssh", "python": sys.executable,
                      "interface": bed_clean.interface(h), "hosts": [{"host": h}]}
                     for c, h in (("east", "e1"), ("west", "w1"))],
        "relay": {"sync": {"mode": "diloco", "inner_steps": 5}, "timeout": 4,
                  "heartbeat": 1, "dead_after": 3,
                  "compression": {"codec": "int8", "error_feedback": True}},
    }
    path = tmp_path / "cut.yaml"
    path.write_text(yaml.safe_dump(spec))
    job_id = ssh_cli("launch", str(path), "--detach", check=True).stdout.strip()

    def joint(cluster: str) -> list[int]:
        return [r["outer_round"] for r in rounds(job_id, cluster) if r["clusters_present"] == 2]

    def alone(cluster: str) -> list[int]:
        return [r["outer_round"] for r in rounds(job_id, cluster) if r["clusters_present"] == 1]

    wait_for(lambda: len(joint("west")) >= 2, timeout=300, every=1.0)
    bed_clean.partition("w1")  # nothing crosses between the clusters any more
    try:
        wait_for(lambda: len(alone("east")) >= 2 and len(alone("west")) >= 2, timeout=120,
                 every=1.0)
    finally:
        bed_clean.restore("w1")
    healed_at = time.time()
    st = wait_for(lambda: (s := json.loads(ssh_cli("status", job_id, "--json").stdout or "{}"))
                  .get("state") not in (None, "RUNNING") and s, timeout=600, every=2.0)
    assert st["state"] == "SUCCEEDED", st
    assert all(h["restarts"] == 0 for h in st["hosts"]), st["hosts"]  # no restart needed
    for cluster in ("east", "west"):
        after = [r for r in rounds(job_id, cluster) if r["ts"] > healed_at]
        assert sum(r["clusters_present"] == 2 for r in after) >= 3, (cluster, after)
    # each side averaged alone: their states differed, and one took the other's
    assert any(r.get("caught_up") for c in ("east", "west") for r in rounds(job_id, c))
    records = [json.loads(line) for p in (REMOTE_JOBS / job_id).glob("*/*/worker/metrics/*.jsonl")
               for line in p.read_text().splitlines() if line]
    finals = [r for r in records if r.get("final")]
    assert len(finals) == 2 and len({r["param_sha256"] for r in finals}) == 1, finals
    assert job_processes(job_id) == []
