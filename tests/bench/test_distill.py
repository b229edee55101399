"""bench/distill.py's sites get a distill.json the runtime loads strictly (it had been built
without the fields distill.json gained, and every run failed before training): for each kind
of label, at the spec's defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from helpers.bench_modules import load_bench

from nebula_cli.config import strict
from nebula_cli.config.distill_config import DistillConfig
from nebula_cli.config.distill_spec import DistillSpec


@pytest.mark.parametrize("labels, values", [("sampled", "draws"), ("topk", "int8")])
def test_the_sites_distill_json_loads_as_the_runtime_reads_it(
        tmp_path: Path, labels: str, values: str) -> None:
    bench = load_bench("distill")
    d = DistillSpec()
    args = argparse.Namespace(k=d.topk, temperature=d.temperature, alpha=d.alpha,
                              lookahead=d.lookahead, labels=labels, values="int8")
    cfg = bench.cfg(tmp_path / "pki", "lab", "t1", {"lab": "127.0.0.1:1"}, "127.0.0.1:1", args)
    path = tmp_path / "distill.json"
    path.write_bytes(strict.dumps(cfg))
    loaded = DistillConfig.load(path)
    assert loaded == cfg and loaded.values == values and loaded.teacher
    assert (loaded.topk, loaded.temperature, loaded.alpha) == (d.topk, d.temperature, d.alpha)
