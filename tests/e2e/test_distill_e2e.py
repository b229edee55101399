"""Distillation end to end on this machine: the built-in teacher server (a Hugging Face GPT-2
directory, `hf_server`, its own process with its label relay) and a student cluster of two
gloo ranks training a smaller GPT-2 from its soft labels through mutual TLS. Every batch
comes with labels, the KD loss falls, both ranks end identical, the teacher leaves on
SIGTERM and nothing is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.label_teacher import distill_cfg, job_pki, peaked_teacher
from helpers.sshd_bed import free_port
from transformers import GPT2Config, GPT2LMHeadModel

from nebula_cli.config import strict
from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV

TESTS = Path(__file__).resolve().parents[1]
VOCAB, WIDTH, STEPS = 512, 32, 8


@pytest.mark.slow
def test_a_student_cluster_learns_from_a_teacher_cluster(tmp_path: Path) -> None:
    pki, port = job_pki(tmp_path / "pki"), free_port()
    torch.manual_seed(3)
    teacher_model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=WIDTH, n_embd=64,
                                               n_layer=2, n_head=2))
    peaked_teacher(teacher_model).save_pretrained(tmp_path / "teacher")
    torch.save(torch.randint(0, VOCAB, (2 * 4 * STEPS, WIDTH)), tmp_path / "data.pt")
    teachers = {"lab": f"127.0.0.1:{port}"}
    t_cfg = distill_cfg(pki, "lab", "t1", teachers=teachers, listen=f"127.0.0.1:{port}",
                        model=str(tmp_path / "teacher"), batch_tokens=4096, topk=16)
    s_cfg = distill_cfg(pki, "cloud", "s1", teachers=teachers, topk=16, lookahead=2,
                        wait_s=60.0)
    (tmp_path / "t.json").write_bytes(strict.dumps(t_cfg))
    (tmp_path / "s.json").write_bytes(strict.dumps(s_cfg))
    base = {**os.environ, "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1"}
    teacher = subprocess.Popen(
        [sys.executable, "-m", "nebula_cli.runtime.distill.hf_server"],
        env=base | {DISTILL_CONFIG_ENV: str(tmp_path / "t.json"), "RANK": "0"})
    master = free_port()
    students = [subprocess.Popen(
        [sys.executable, "-m", "helpers.distill_student", str(tmp_path / f"r{r}.json"),
         str(STEPS)],
        env=base | {DISTILL_CONFIG_ENV: str(tmp_path / "s.json"), "RANK": str(r),
                    "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master),
                    "DISTILL_DATA": str(tmp_path / "data.pt"), "DISTILL_VOCAB": str(VOCAB)})
        for r in range(2)]
    try:
        assert [p.wait(timeout=150) for p in students] == [0, 0]
        teacher.send_signal(signal.SIGTERM)
        assert teacher.wait(timeout=30) == 0
    finally:
        for p in [*students, teacher]:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    assert results[0]["digest"] == results[1]["digest"]  # identical parameters
    for r in results:
        assert r["steps"] == STEPS and r["without_labels"] == 0
        assert r["kd_last"] < r["kd_first"], r
        # 16 labels of 9-bit ids and fp16 values, a 9-bit token id (ids up to 511 in every
        # ask of 128): 18 + 32 + 1.125 bytes (protocol 1 sent 4 bytes of token id: 54)
        assert r["bytes_per_token"] == 51.125
    time.sleep(0.1)
    assert all(p.poll() is not None for p in [*students, teacher])
