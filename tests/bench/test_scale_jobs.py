"""bench/_scale_jobs.py: a round's time from the clusters' rank-0 records (the last start to the
last end), the busiest relay's bytes, and the job's spec with and without `relay:`."""

from __future__ import annotations

from pathlib import Path

import yaml
from helpers.bench_modules import load_bench


def test_a_round_runs_from_the_last_contribution_to_the_last_apply() -> None:
    m = load_bench("_scale_jobs")
    workers = [
        {"rank": 0, "cluster": "east", "applied": True, "outer_round": 0, "ts": 10.0,
         "round_s": 3.0, "relay_s": 2.5},  # started at 7, waited for west
        {"rank": 0, "cluster": "west", "applied": True, "outer_round": 0, "ts": 10.5,
         "round_s": 1.5, "relay_s": 1.0},  # the last contribution, at 9
        {"rank": 1, "cluster": "west", "final": True},
        {"rank": 0, "cluster": "east", "applied": True, "outer_round": 1, "ts": 20.0,
         "round_s": 1.0},  # west's record of round 1 is missing: not a round of both
    ]
    relays = [{"round": 0, "bytes_sent": 100, "bytes_received": 120},
              {"round": 0, "bytes_sent": 130, "bytes_received": 90}]
    (only,) = m.round_times(workers, relays)
    assert (only.round, only.seconds, only.relay_s, only.wan_bytes) == (0, 1.5, 2.5, 130)


def test_the_spec_has_a_relay_only_with_a_codec(tmp_path: Path) -> None:
    m = load_bench("_scale_jobs")
    base = dict(model=m.Model("x", 64, 2, 2), ranks=2, steps=8, inner_steps=4, seed=1,
                micro_batch=4)
    link = m.Link("1g", 1000.0, 10.0)
    with_relay = yaml.safe_load(m.write_spec(tmp_path, m.JobSpec(codec="int8", link=link,
                                                                 **base)).read_text())
    alone = yaml.safe_load(m.write_spec(tmp_path, m.JobSpec(codec=None, link=None,
                                                            **base)).read_text())
    assert with_relay["relay"]["shaping"] == {"rate_mbit": 1000.0, "delay_ms": 10.0}
    assert with_relay["relay"]["sync"]["inner_steps"] == 4
    assert "relay" not in alone
    assert [len(c["hosts"]) for c in alone["clusters"]] == [2, 2]
    assert "--d-model 64 --n-layer 2 --n-head 2" in alone["run"]
