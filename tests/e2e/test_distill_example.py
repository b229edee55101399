"""examples/distill as a user runs it: its nebula.yaml launched unchanged but for the number of
steps, a teacher saved where its README says (examples/distill/teacher/). The student trains on
the BPE vocabulary from every batch's soft labels and the job ends SUCCEEDED with nothing left
running. (The example once failed under `nebula launch`: its tokenizer looked for the corpus
beside the uploaded folder, which a job's copy does not have.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers.jobs import CLI, REPO, job_processes
from transformers import GPT2Config, GPT2LMHeadModel

pytestmark = pytest.mark.slow

STEPS = 6


def test_the_distill_example_runs_under_nebula_launch(cli: CLI, tmp_path: Path) -> None:
    examples = tmp_path / "examples"
    shutil.copytree(REPO / "examples", examples, ignore=shutil.ignore_patterns("out", "teacher"))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_positions=64, n_embd=32, n_layer=1,
                               n_head=2)).save_pretrained(examples / "distill" / "teacher")
    path = examples / "distill" / "nebula.yaml"
    spec = yaml.safe_load(path.read_text())
    spec["env"] = {"STEPS": str(STEPS), "OMP_NUM_THREADS": "1"}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))

    proc = cli("launch", str(path), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job_id,) = cli.job_ids()
    st = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED", st
    assert job_processes(job_id) == []
    soft = st["metrics"]["cloud"]
    assert soft["distill_batches"] == STEPS and soft["distill_without_labels"] == 0, soft
    # 2048 tokens: 11-bit ids both ways; the default labels, 12 draws, send ids only:
    # 12 x 11 / 8 + 11 / 8 bytes a token
    per_token = 12 * 11 / 8 + 11 / 8
    assert soft["distill_bytes_per_token"] == pytest.approx(per_token, abs=0.01), soft
    logs = cli("logs", job_id, check=True).stdout
    assert "eval loss" in logs and "on cpu" in logs, logs[-2000:]
    # run in place (the local transport uses the workdir as it is): nothing written into it
    assert not (examples / "out").exists()
