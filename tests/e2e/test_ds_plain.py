"""Unmodified scripts under `nebula launch` (real DeepSpeed on CPU/gloo, real relays, local
transport): the automatic hook syncs a plain DeepSpeed script across two clusters and every
worker ends with the same parameters, also when the step count is not a multiple of
inner_steps; a script without DeepSpeed is told apart; runtime.auto: false leaves a script
alone."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from helpers.ds_plain import (
    INNER,
    copy_example,
    edited,
    job_files,
    launched,
    records,
    spec_file,
)
from helpers.jobs import CLI

pytestmark = pytest.mark.slow

STEPS = 35  # not a multiple of INNER: the 4th round is the final one


def worker_logs(cli: CLI, job_id: str) -> str:
    return "".join(p.read_text() for p in job_files(cli, job_id, "*/*/worker/logs/*.log"))


def test_plain_deepspeed_script_syncs_and_every_worker_ends_identical(
        cli: CLI, tmp_path: Path) -> None:
    """east runs examples/ds_plain/train.py as it is (2 ranks; it destroys its process group at
    the end). west runs a variant that binds `from deepspeed import initialize`, first builds a
    reference engine without an optimizer (not synced), and just exits (the final round runs
    at exit)."""
    work = copy_example(tmp_path)
    (work / "train_ref.py").write_text(edited(
        (work / "train.py").read_text(),
        ("import deepspeed\n", "import deepspeed\nfrom deepspeed import initialize\n"),
        ("    torch.manual_seed(args.seed)", "    initialize(model=ByteModel(), config={"
         "'train_micro_batch_size_per_gpu': 4})  # a reference engine\n"
         "    torch.manual_seed(args.seed)"),
        ("deepspeed.initialize(model=model", "initialize(model=model"),
        ("    dist.destroy_process_group()\n", "")))
    spec = spec_file(tmp_path, "plain", {"east": ["e1", "e2"], "west": ["w1"]},
                     run=f"python -u $SCRIPT --steps {STEPS}")
    data = yaml.safe_load(spec.read_text())
    data["clusters"][0]["env"] = {"SCRIPT": "train.py"}
    data["clusters"][1]["env"] = {"SCRIPT": "train_ref.py"}
    spec.write_text(yaml.safe_dump(data))

    job_id, out = launched(cli, spec)
    assert "all 3 workers hold identical parameters" in out

    recs = records(cli, job_id)
    finals = [r for r in recs if r.get("final")]
    assert len(finals) == 3 and len({r["param_sha256"] for r in finals}) == 1
    assert {r["ended_by"] for r in finals if r["cluster"] == "east"} == {"destroy_process_group"}
    assert {r["ended_by"] for r in finals if r["cluster"] == "west"} == {"exit"}
    assert all(r["step"] == STEPS and r["final_round"] and r["cross_cluster_sync"]
               and r["outer_rounds"] == STEPS // INNER + 1 for r in finals)
    assert all(r["final_round_error"] is None for r in finals)
    assert finals[0]["last_loss"] < finals[0]["first_loss"] - 1.0, "the loss did not fall"

    rounds = [r for r in recs if r.get("outer_round") is not None and "round_s" in r]
    for cluster in ("east", "west"):  # rank 0 of each cluster records its rounds
        mine = [r for r in rounds if r["cluster"] == cluster]
        assert [r["outer_round"] for r in mine] == list(range(STEPS // INNER + 1))
        assert [r["step"] for r in mine] == [INNER, 2 * INNER, 3 * INNER, STEPS]
        assert mine[-1]["final_round"] and all(r["clusters_present"] == 2 for r in mine)
    steps = [r for r in recs if "samples_per_s" in r]
    assert steps and all(r["loss"] > 0 and r["steps_per_s"] > 0 for r in steps)
    # the accumulation boundary counts: 16 samples x 2 micro-steps x ranks per optimizer step
    east = [r for r in steps if r["cluster"] == "east"]
    assert east[-1]["samples_per_s"] == pytest.approx(east[-1]["steps_per_s"] * 16 * 2 * 2)

    relay_rounds = [r for r in records(cli, job_id, "relay") if "round" in r]
    for cluster in ("east", "west"):
        got = sorted(r["round"] for r in relay_rounds if r["cluster"] == cluster)
        assert got == list(range(STEPS // INNER + 1))
        assert all(sorted(r["present"]) == ["east", "west"] for r in relay_rounds)
    logs = worker_logs(cli, job_id)
    assert logs.count("a DeepSpeed engine without an optimizer") == 1  # west's reference


def test_a_script_without_deepspeed_is_said_to_have_synced_nothing(
        cli: CLI, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "ddp.py").write_text(textwrap.dedent("""
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
        print("ddp done", flush=True)
        dist.destroy_process_group()
    """))
    spec = spec_file(tmp_path, "noengine", {"east": ["e1", "e2"], "west": ["w1"]},
                     run="python -u ddp.py")
    job_id, _ = launched(cli, spec)
    logs = worker_logs(cli, job_id)
    assert logs.count("ddp done") == 3
    assert logs.count("no DeepSpeed engine was seen") == 2  # once per cluster (its rank 0)
    assert "no cross-cluster sync happened" in logs
    said = [r for r in records(cli, job_id) if r.get("no_deepspeed_engine")]
    assert sorted((r["cluster"], r["rank"], r["cross_cluster_sync"]) for r in said) == [
        ("east", 0, False), ("west", 0, False)]
    assert not [r for r in records(cli, job_id, "relay") if "round" in r]


def test_runtime_auto_false_leaves_the_script_alone(cli: CLI, tmp_path: Path) -> None:
    copy_example(tmp_path)
    spec = spec_file(tmp_path, "noauto", {"east": ["e1"], "west": ["w1"]},
                     run="python -u train.py --steps 12", runtime={"auto": False})
    job_id, _ = launched(cli, spec)
    logs = worker_logs(cli, job_id)
    assert logs.count("step 10 loss") == 2  # the script trained in both clusters
    assert "nebula:" not in logs  # the hook never spoke
    assert records(cli, job_id) == []  # nor recorded anything
    assert not [r for r in records(cli, job_id, "relay") if "round" in r]
