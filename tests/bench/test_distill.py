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


def test_the_on_policy_sites_distill_json_scores_the_students_tokens(tmp_path: Path) -> None:
    bench = load_bench("distill")
    d = DistillSpec()
    args = argparse.Namespace(k=d.topk, temperature=d.temperature, alpha=d.alpha,
                              lookahead=d.lookahead, labels=d.labels, values=d.values)
    cfg = bench.cfg(tmp_path / "pki", "lab", "t1", {"lab": "127.0.0.1:1"}, "127.0.0.1:1", args,
                    scored=True)
    path = tmp_path / "distill.json"
    path.write_bytes(strict.dumps(cfg))
    loaded = DistillConfig.load(path)
    assert loaded == cfg and (loaded.values, loaded.topk) == ("token", 1)


def test_the_teacher_is_built_once_per_settings_and_cached_outside_the_checkout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    bench = load_bench("distill")
    monkeypatch.setattr(bench, "CACHE", tmp_path / "cache")
    tokenizer = tmp_path / "bpe.json"
    tokenizer.write_text('{"vocab": "of the test"}')
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(2)]
    built, first_s, folder = bench.cached_teacher(tokenizer, 64, 2, batches)
    assert first_s is None and folder.parent == tmp_path / "cache"  # built here, then saved
    assert (folder / "config.json").is_file() and float((folder / "built_s").read_text()) >= 0
    loaded, built_s, again = bench.cached_teacher(tokenizer, 64, 2, batches)
    assert again == folder and built_s == float((folder / "built_s").read_text())
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(),
                                                 loaded.state_dict().values(), strict=True))
    other = bench.cached_teacher(tokenizer, 64, 2, batches[:1])[2]  # other batches: another
    assert other != folder and sorted(p.name for p in (tmp_path / "cache").iterdir()) == \
        sorted([folder.name, other.name])  # no half-built folder left
