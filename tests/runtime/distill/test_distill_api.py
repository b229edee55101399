"""The student's and the teacher's distillation API (`runtime.distill`) with a real teacher
(`serve` in a thread: its label relay and serving link on loopback, mutual TLS): every batch
comes once, in order, with its teacher's top k; the loss is GKD's forward KL (beta 0) on the
top k; with no teacher, `ce_only` trains on and counts, `wait` fails naming the teachers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.label_teacher import distill_cfg, job_pki, serving_teacher
from helpers.sshd_bed import free_port

from nebula_cli.config.distill_config import DistillConfig
from nebula_cli.runtime.distill import kd_loss, soft_labelled, topk_labels
from nebula_cli.runtime.distill.loader import DistillError, SoftLabels

VOCAB, WIDTH = 300, 6


def teacher_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))


def batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, VOCAB, (2, WIDTH), generator=g)} for _ in range(n)]


def student_cfg(pki: Path, port: int, **kw: object) -> DistillConfig:
    return distill_cfg(pki, "cloud", "s1", teachers={"lab": f"127.0.0.1:{port}"}, **kw)


def test_every_batch_comes_once_in_order_with_its_teachers_top_k(tmp_path: Path) -> None:
    pki, port = job_pki(tmp_path / "pki"), free_port()
    data = batches(10)
    model = teacher_model()
    with serving_teacher(pki, port, teacher_model()):
        loader = soft_labelled(data, config=student_cfg(pki, port, lookahead=3))
        try:
            seen = list(loader)
        finally:
            loader.client.close()
    assert [b["input_ids"].tolist() for b, _ in seen] == [b["input_ids"].tolist() for b in data]
    for batch, soft in seen:
        assert soft is not None and soft.teacher == "lab"
        ids, logp = topk_labels(model(batch["input_ids"]).detach(), 4, 2.0)
        assert torch.equal(soft.ids, ids.reshape(2, WIDTH, 4))
        assert torch.allclose(soft.logp, logp.reshape(2, WIDTH, 4), atol=2e-2)
    stats = loader.stats
    assert stats.batches == 10 and stats.without_labels == 0 and stats.tokens == 10 * 2 * WIDTH
    # an answer: 2 x WIDTH tokens' top 4, 9-bit ids and fp16 values; an ask: its ids in the
    # bits of its largest (protocol 1: 4 bytes an id)
    answers = 10 * ((2 * WIDTH * 4 * 9 + 7) // 8 + 2 * WIDTH * 4 * 2)
    asks = sum((2 * WIDTH * int(b["input_ids"].max()).bit_length() + 7) // 8 for b in data)
    assert asks <= 10 * (2 * WIDTH * 9 + 7) // 8
    assert stats.wire_bytes == answers + asks
    assert stats.bytes_per_token == (answers + asks) / (10 * 2 * WIDTH)
    assert loader.client.outstanding() == 0


def test_no_teacher_ce_only_trains_on_and_counts_wait_names_the_teachers(tmp_path: Path) -> None:
    pki, port = job_pki(tmp_path / "pki"), free_port()
    loader = soft_labelled(batches(3), config=student_cfg(pki, port, when_no_teacher="ce_only",
                                                          lookahead=1))
    try:
        assert [soft for _, soft in loader] == [None, None, None]
        assert loader.stats.without_labels == 3 and loader.client.outstanding() == 0
    finally:
        loader.client.close()
    waiting = soft_labelled(batches(1), config=student_cfg(pki, port, wait_s=0.5))
    try:
        with pytest.raises(DistillError, match=r"within 0.5 s from the teachers lab \(linked "
                                               r"now: none\).*when_no_teacher: ce_only"):
            list(waiting)
    finally:
        waiting.client.close()


def test_the_loss_is_forward_kl_on_the_top_k_and_the_full_kl_with_every_id() -> None:
    torch.manual_seed(2)
    student, teacher_logits = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 0] = -100
    t = 2.0
    ids, logp = topk_labels(teacher_logits, 11, t)  # every id: the full distribution
    full = SoftLabels(ids.reshape(2, 5, 11), logp.reshape(2, 5, 11), "lab")
    loss, kd, ce = kd_loss(student, labels, full, temperature=t, alpha=0.25)
    per_token = F.kl_div(F.log_softmax(student / t, -1), F.log_softmax(teacher_logits / t, -1),
                         reduction="none", log_target=True).sum(-1)  # GKD, beta = 0
    mask = labels != -100
    assert kd is not None and ce is not None
    assert torch.allclose(kd, per_token[mask].mean(), atol=1e-5)
    want_ce = F.cross_entropy(student[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1),
                              ignore_index=-100)
    assert torch.allclose(ce, want_ce)
    assert torch.allclose(loss, 0.25 * t * t * kd + 0.75 * ce)
    ids3, logp3 = topk_labels(teacher_logits, 3, t)
    top3 = SoftLabels(ids3.reshape(2, 5, 3), logp3.reshape(2, 5, 3), "lab")
    _, kd3, _ = kd_loss(student, labels, top3, temperature=t, alpha=0.25)
    assert kd3 is not None and kd3 > 0 and not torch.allclose(kd3, kd)
    # the top 3 and the rest as a fourth bucket: the KL between those coarser distributions
    p3 = logp3.exp()
    q = F.log_softmax(student.reshape(-1, 11) / t, -1).exp()
    q3 = q.gather(-1, ids3)
    buckets_p = torch.cat([p3, 1 - p3.sum(-1, keepdim=True)], -1)
    buckets_q = torch.cat([q3, 1 - q3.sum(-1, keepdim=True)], -1)
    want3 = (buckets_p * (buckets_p.log() - buckets_q.log())).sum(-1)
    assert torch.allclose(kd3, want3[mask.reshape(-1)].mean(), atol=1e-5)
    only_ce, none_kd, _ = kd_loss(student, labels, None, temperature=t, alpha=0.25)
    assert none_kd is None and torch.allclose(only_ce, want_ce)
    trained = student.clone().requires_grad_()  # the gradient pulls the student to the teacher
    opt = torch.optim.SGD([trained], lr=5.0)
    first = None
    for _ in range(50):
        opt.zero_grad()
        loss, kd, _ = kd_loss(trained, None, full, temperature=t, alpha=1.0)
        first = first if first is not None else kd.item()
        loss.backward()
        opt.step()
    assert kd.item() < 0.05 * first
