"""Distillation over real SSH (issue 24): the teacher cluster `lab` on host e1 of the bed's east
site (the built-in server of a tiny Hugging Face GPT-2), the student cluster `cloud` on w1 of
the west site (two gloo ranks of helpers.distill_student); the soft labels cross the bed's
shaped link between the sites, sampled (`labels: sampled`: ids only), under the job's mutual
TLS. Every batch comes with its labels, both ranks end identical, the teacher is ended once the
students are done, and nothing of the job is left on any host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers.jobs import CLI, REPO, job_processes
from helpers.label_teacher import peaked_teacher
from helpers.ssh_jobs import ssh_spec
from transformers import GPT2Config, GPT2LMHeadModel

from testbed import TestBed

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

VOCAB, WIDTH, STEPS, DRAWS = 512, 32, 8, 12


def test_a_student_site_learns_from_a_teacher_site_over_ssh(ssh_cli: CLI, bed_clean: TestBed,
                                                            tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    torch.manual_seed(3)
    peaked_teacher(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=WIDTH, n_embd=64,
                                              n_layer=2, n_head=2))).save_pretrained(
        work / "teacher")
    torch.save(torch.randint(0, VOCAB, (2 * 4 * STEPS, WIDTH)), work / "data.pt")
    spec = ssh_spec(tmp_path, bed_clean, clusters={"lab": ["e1"], "cloud": ["w1"]},
                    run=f"python -u -m helpers.distill_student {work}/r$RANK.json {STEPS}",
                    relay={}, name="distill-bed", workdir=work)
    data = yaml.safe_load(spec.read_text())
    data["runtime"] = {"auto": False}  # the student trains with gloo, not DeepSpeed
    data["distill"] = {"labels": "sampled", "topk": DRAWS, "temperature": 1.0,
                       "lookahead": 2, "wait_s": 120.0}
    lab, cloud = data["clusters"]
    lab.update(role="teacher", teacher={"model": "teacher", "batch_tokens": 4096})
    cloud["hosts"] = [{"host": "w1", "slots": 2}]
    cloud["env"] = {"PYTHONPATH": str(REPO / "tests"), "DISTILL_DATA": str(work / "data.pt"),
                    "DISTILL_VOCAB": str(VOCAB)}
    spec.write_text(yaml.safe_dump(data))

    proc = ssh_cli("launch", str(spec), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job_id,) = ssh_cli.job_ids()
    st = json.loads(ssh_cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED", st
    assert job_processes(job_id) == []  # the teacher's server on e1 too
    soft = st["metrics"]["cloud"]
    assert soft["distill_batches"] == STEPS and soft["distill_without_labels"] == 0, soft
    # 9-bit ids: 12 drawn ids a token, no values; an ask: the bits of its largest id (<= 9)
    assert DRAWS * 9 / 8 < soft["distill_bytes_per_token"] <= DRAWS * 9 / 8 + 9 / 8 + 0.01
    assert st["metrics"]["lab"]["teacher_answers"] >= 2 * STEPS  # both ranks' asks
    results = [json.loads((work / f"r{r}.json").read_text()) for r in range(2)]
    assert results[0]["digest"] == results[1]["digest"]  # identical parameters
    assert all(r["steps"] == STEPS and r["without_labels"] == 0 for r in results), results
    assert all(r["kd_last"] < r["kd_first"] for r in results), results
    (teacher,) = [h for h in st["hosts"] if h["cluster"] == "lab"]
    assert teacher["state"] == "STOPPED", teacher
    assert teacher["detail"]["reason"] == "ended after the training finished"
