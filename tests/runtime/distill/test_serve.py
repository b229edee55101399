"""What a teacher's serving link answers (`serve.answerer`: its top k, or k drawn tokens seeded
by the asked tokens, on the CPU and on a CUDA device where there is one), and a teacher's
figures (`serve.teacher_record`, rank 0's records of its label relay): answers
per second, their latency and the queue, written into the job's metrics while it serves and once
when it stops. The real label relay's counts are tested in tests/relay/distill/test_label_relay.py,
and the records through `nebula launch` in tests/e2e/test_distill_launch.py."""

from __future__ import annotations

import importlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.jobs import wait_for
from helpers.label_teacher import distill_cfg

from nebula_cli.relay.distill.label_relay import RelayCounts
from nebula_cli.runtime.distill import topk_labels
from nebula_cli.runtime.distill.serve import (
    TeacherLoss,
    answerer,
    report_figures,
    teacher_record,
)

SERVE = importlib.import_module("nebula_cli.runtime.distill.serve")  # the module, not serve()
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_the_answer_is_the_top_k_or_draws_seeded_by_the_tokens(device: str,
                                                                tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)).to(device)
    forward = lambda ids: model(ids)  # noqa: E731
    tokens = np.random.default_rng(1).integers(0, 50, size=(3, 5))
    cfg = distill_cfg(tmp_path, "lab", "t1", teachers={}, topk=6)
    top = answerer(forward, cfg, device)(tokens)
    ids, logp = topk_labels(model(torch.from_numpy(tokens).to(device)).detach(), 6,
                            cfg.temperature)
    assert np.array_equal(top.ids, ids.cpu().numpy())
    assert np.allclose(top.logp, logp.cpu().numpy())
    drawn = answerer(forward, distill_cfg(tmp_path, "lab", "t1", teachers={}, topk=6,
                                          values="draws"), device)
    first, again, other = drawn(tokens), drawn(tokens.copy()), drawn(tokens[::-1].copy())
    assert np.array_equal(first.ids, again.ids) and np.array_equal(first.logp, again.logp)
    assert not np.array_equal(first.ids, other.ids)
    assert first.ids.shape == (15, 6) and np.allclose(np.exp(first.logp).sum(1), 1.0)


@pytest.mark.parametrize("chunk", [SERVE.LOSS_CHUNK, 6 * 50])  # all at once; one sequence
def test_the_teachers_own_loss_on_the_asked_batches_is_their_next_token_cross_entropy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(SERVE, "LOSS_CHUNK", chunk)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
    loss = TeacherLoss()
    answer = answerer(lambda ids: model(ids), distill_cfg(tmp_path, "lab", "t1", teachers={}),
                      "cpu", loss)
    batches = [np.random.default_rng(s).integers(0, 50, size=(2, 6)) for s in (1, 2)]
    for tokens in batches:
        answer(tokens)
    with torch.no_grad():  # by hand: position t scored on token t + 1, over both asks
        nll = [torch.nn.functional.cross_entropy(
            model(torch.from_numpy(t))[:, :-1].reshape(-1, 50), torch.from_numpy(t)[:, 1:]
            .reshape(-1), reduction="sum") for t in batches]
    assert loss.take() == pytest.approx(float(sum(nll)) / (2 * 2 * 5), rel=1e-5)
    assert loss.take() is None  # taken: the next interval starts empty
    answer(np.zeros((3, 1), dtype=np.int64))  # one position scores nothing
    assert loss.take() is None


def counts(answers: int, latency_s: float, pending: int = 0) -> RelayCounts:
    return RelayCounts(asks=answers + pending, answers=answers, pending=pending, servers=2,
                       students=1, refused=0, tokens=64 * answers, latency_s=latency_s)


def test_a_record_says_the_intervals_rate_and_latency_and_the_queue_now() -> None:
    rec = teacher_record(counts(10, 2.0), counts(30, 3.0, pending=3), seconds=4.0)
    assert rec == {"teacher_answers": 30, "teacher_tokens": 1920, "teacher_answers_per_s": 5.0,
                   "teacher_latency_ms": 50.0, "teacher_queue": 3, "teacher_servers": 2,
                   "teacher_students": 1, "teacher_ce": None}
    assert teacher_record(counts(10, 2.0), counts(30, 3.0), 4.0, ce=2.3456789)["teacher_ce"] \
        == 2.34568
    idle = teacher_record(counts(30, 3.0), counts(30, 3.0), seconds=5.0)
    assert idle["teacher_answers_per_s"] == 0.0 and idle["teacher_latency_ms"] is None


class Scripted:
    """A label relay's counts as a script of them (the real one: test_label_relay.py)."""

    cluster = "lab"

    def __init__(self) -> None:
        self.answers = 0
        self.lock = threading.Lock()

    def counts(self) -> RelayCounts:
        with self.lock:
            self.answers += 4
            return counts(self.answers, 0.01 * self.answers)


def test_rank_0_writes_a_record_every_interval_and_one_at_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rank0.jsonl"
    monkeypatch.setenv("NEBULA_METRICS_FILE", str(path))
    served = threading.Event()
    reporter = threading.Thread(target=report_figures, args=(Scripted(), served, 0.05))
    reporter.start()
    try:
        assert wait_for(lambda: path.exists() and len(path.read_text().splitlines()) >= 3,
                        timeout=10)
    finally:
        served.set()
        reporter.join(5)
    assert not reporter.is_alive()  # stopped at once, with a last record
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) >= 4
    assert all(r["step"] == r["teacher_answers"] for r in records)  # a teacher's "step"
    answers = [r["teacher_answers"] for r in records]
    assert answers == sorted(answers) and len(set(answers)) == len(answers)
    assert all(r["teacher_latency_ms"] == 10.0 and r["teacher_answers_per_s"] > 0
               for r in records)


def test_a_record_that_cannot_be_written_does_not_end_the_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A metrics file that cannot be written (here a directory stands where it should be)
    costs those records only: the figures come back once it can be written again."""
    path = tmp_path / "rank0.jsonl"
    path.mkdir()  # opening it for writing fails (IsADirectoryError, an OSError)
    monkeypatch.setenv("NEBULA_METRICS_FILE", str(path))
    served = threading.Event()
    reporter = threading.Thread(target=report_figures, args=(Scripted(), served, 0.05))
    reporter.start()
    try:
        assert wait_for(lambda: "could not write its figures" in caplog.text, timeout=10)
        assert reporter.is_alive()
        path.rmdir()
        assert wait_for(lambda: path.is_file() and path.read_text().strip(), timeout=10)
    finally:
        served.set()
        reporter.join(5)
    assert not reporter.is_alive()
    assert json.loads(path.read_text().splitlines()[-1])["teacher_answers"] > 0
