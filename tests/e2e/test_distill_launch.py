"""Distillation through `nebula launch`: a spec with a teacher cluster (`lab`, the built-in
server of a tiny Hugging Face GPT-2) and a student cluster (`cloud`, two gloo ranks of
helpers.distill_student) on the local transport. The job ends SUCCEEDED by itself: the
teacher's processes are ended once the students are done; every student batch came with soft
labels (the loader's metric records, in `nebula status --json`), the KD loss fell, both
ranks end identical, and nothing of the job is left running."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers.jobs import CLI, REPO, job_processes
from helpers.label_teacher import peaked_teacher
from transformers import GPT2Config, GPT2LMHeadModel

pytestmark = pytest.mark.slow

VOCAB, WIDTH, STEPS = 512, 32, 8


def spec_file(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    torch.manual_seed(3)
    teacher_model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=WIDTH, n_embd=64,
                                               n_layer=2, n_head=2))
    peaked_teacher(teacher_model).save_pretrained(work / "teacher")
    torch.save(torch.randint(0, VOCAB, (2 * 4 * STEPS, WIDTH)), work / "data.pt")
    spec = {
        "name": "distill-launch", "workdir": str(work), "relay": {},
        "run": f"python -u -m helpers.distill_student {work}/r$RANK.json {STEPS}",
        "runtime": {"auto": False},  # the student trains with gloo, not DeepSpeed
        "env": {"OMP_NUM_THREADS": "1"},
        "distill": {"topk": 16, "lookahead": 2, "wait_s": 60.0},
        "clusters": [
            {"name": "lab", "transport": "local", "role": "teacher",
             "teacher": {"model": "teacher", "batch_tokens": 4096}, "hosts": ["lab1"]},
            {"name": "cloud", "transport": "local", "hosts": [{"host": "c1", "slots": 2}],
             "env": {"PYTHONPATH": str(REPO / "tests"), "DISTILL_DATA": str(work / "data.pt"),
                     "DISTILL_VOCAB": str(VOCAB)}},
        ],
    }
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_launched_student_cluster_learns_from_its_teacher_cluster(
        cli: CLI, tmp_path: Path) -> None:
    proc = cli("launch", str(spec_file(tmp_path)), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job_id,) = cli.job_ids()
    st = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED", st
    assert job_processes(job_id) == []  # the teacher's server too

    soft = st["metrics"]["cloud"]  # the loader's last record (its end)
    assert soft["distill_batches"] == STEPS and soft["distill_without_labels"] == 0, soft
    assert "distill_batches" not in st["metrics"].get("lab", {})

    results = [json.loads((tmp_path / "work" / f"r{r}.json").read_text()) for r in range(2)]
    assert results[0]["digest"] == results[1]["digest"]  # identical parameters
    for r in results:
        assert r["steps"] == STEPS and r["without_labels"] == 0
        assert r["kd_last"] < r["kd_first"], r

    # the teacher serves until told to stop: nebula ended it once the students had ended
    (lab,) = [h for h in st["hosts"] if h["cluster"] == "lab"]
    (cloud,) = [h for h in st["hosts"] if h["cluster"] == "cloud" and h["role"] == "worker"]
    assert lab["state"] == "STOPPED" and cloud["state"] == "SUCCEEDED", st["hosts"]
    assert lab["detail"]["reason"] == "ended after the training finished"
    assert lab["detail"]["ended"] >= cloud["detail"]["ended"]
    assert lab["detail"]["exit_codes"] == {"0": 0}  # hf_server left cleanly on SIGTERM
