"""runtime/distill/loader: the loader's own metric records (what `nebula status` shows of a
student's soft labels), and a batch the teacher cannot run; its batches and labels are tested
with a real teacher in test_distill_api.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.label_teacher import distill_cfg, job_pki, serving_teacher
from helpers.sshd_bed import free_port

from nebula_cli.runtime.distill import soft_labelled
from nebula_cli.runtime.distill.loader import DistillError


def test_batches_without_a_teacher_are_counted_in_the_metrics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No teacher answers (ce_only): every batch trains without labels, and the records say so
    every `report_every` batches and once more when the loader ends."""
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("NEBULA_METRICS_FILE", str(path))
    monkeypatch.setenv("NEBULA_CLUSTER", "cloud")
    cfg = distill_cfg(job_pki(tmp_path / "pki"), "cloud", "s1",
                      teachers={"lab": f"127.0.0.1:{free_port()}"},
                      when_no_teacher="ce_only", lookahead=1)
    data = [{"input_ids": torch.zeros(2, 4, dtype=torch.long)} for _ in range(5)]
    loader = soft_labelled(data, config=cfg, report_every=2)
    try:
        assert [soft for _, soft in loader] == [None] * 5
    finally:
        loader.client.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["distill_batches"], r["distill_without_labels"]) for r in records] == [
        (2, 2, 2), (4, 4, 4), (5, 5, 5)]
    assert all(r["cluster"] == "cloud" and r["distill_bytes_per_token"] == 0 for r in records)
    assert records[-1]["distill_wait_s"] >= records[-1]["distill_longest_wait_s"] >= 0


def test_a_batch_beyond_the_teachers_vocabulary_stops_the_student_naming_both(
        tmp_path: Path) -> None:
    """A student tokenizer larger than the teacher's: its batch is refused (by the client once
    linked, else by the label relay) naming the teacher's vocabulary, and the teacher's
    serving rank lives on: a batch that fits is answered after it."""
    pki, port = job_pki(tmp_path / "pki"), free_port()
    torch.manual_seed(0)
    vocab = 300
    teacher = torch.nn.Sequential(torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab))
    cfg = distill_cfg(pki, "cloud", "s1", teachers={"lab": f"127.0.0.1:{port}"}, lookahead=0)
    with serving_teacher(pki, port, teacher):
        bad = [{"input_ids": torch.tensor([[1, vocab + 100]])}]
        loader = soft_labelled(bad, config=cfg)
        try:
            with pytest.raises(DistillError, match=f"vocabulary is {vocab} tokens"):
                list(loader)
        finally:
            loader.client.close()
        good = soft_labelled([{"input_ids": torch.tensor([[1, 2]])}], config=cfg)
        try:
            [(_, soft)] = list(good)
        finally:
            good.client.close()
    assert soft is not None and soft.vocab == vocab


def test_a_declared_student_vocabulary_refuses_a_teacher_with_another_naming_both(
        tmp_path: Path) -> None:
    """`distill.vocab` says the students' tokenizer: a teacher whose model has another size
    (here smaller, whose ids all fit the student's, so the loss alone would train on) is
    refused at its first answer, both sizes and the teacher named."""
    pki, port = job_pki(tmp_path / "pki"), free_port()
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Embedding(300, 8), torch.nn.Linear(8, 300))
    teachers = {"lab": f"127.0.0.1:{port}"}
    with serving_teacher(pki, port, teacher):
        for vocab, refused in ((512, True), (300, False)):
            cfg = distill_cfg(pki, "cloud", "s1", teachers=teachers, lookahead=0, vocab=vocab)
            loader = soft_labelled([{"input_ids": torch.tensor([[1, 2]])}], config=cfg)
            try:
                if refused:
                    with pytest.raises(DistillError) as exc:
                        list(loader)
                    assert str(exc.value) == (
                        "teacher lab's model has a vocabulary of 300 and this student's "
                        "(distill.vocab) is 512: a student learns only from a teacher with its "
                        "own tokenizer and vocabulary")
                else:
                    [(_, soft)] = list(loader)
                    assert soft is not None and soft.vocab == 300
            finally:
                loader.client.close()
