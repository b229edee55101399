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
from nebula_cli.config.distill_spec import DistillSpec
from nebula_cli.relay.distill.sparse import from_draws
from nebula_cli.runtime.distill import kd_loss, soft_labelled, topk_labels
from nebula_cli.runtime.distill.loader import DistillError, SoftLabels
from nebula_cli.runtime.distill.loss import sampled_labels

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
        ids, logp = topk_labels(model(batch["input_ids"]).detach(), 4,
                                DistillSpec().temperature)  # the teacher's, its default
        assert torch.equal(soft.ids, ids.reshape(2, WIDTH, 4))
        assert torch.allclose(soft.logp, logp.reshape(2, WIDTH, 4), atol=2e-2)
    stats = loader.stats
    assert stats.batches == 10 and stats.without_labels == 0 and stats.tokens == 10 * 2 * WIDTH
    # kd_loss adds each batch's KD term to the loader's figures: the record has their mean
    student = torch.nn.Linear(1, VOCAB)
    kds = [kd_loss(student(torch.ones(2, WIDTH, 1)), None, soft, temperature=2.0,
                   alpha=1.0)[1] for _, soft in seen[:4]]
    assert stats.kd_steps == 4
    record = stats.record()
    assert record["distill_kd"] == pytest.approx(float(sum(kds)) / 4, abs=1e-5)
    assert stats.kd_steps == 0 and stats.record()["distill_kd"] is None  # an interval's mean
    assert record["distill_ce"] is None  # no hard labels given: no student loss to show
    # with the batch's own tokens as hard labels, the student's loss on them beside the KD term
    ces = [kd_loss(student(torch.ones(2, WIDTH, 1)), b["input_ids"], soft, temperature=1.0,
                   alpha=0.9)[2] for b, soft in seen[:3]]
    assert stats.record()["distill_ce"] == pytest.approx(float(sum(ces)) / 3, abs=1e-5)
    # an answer: 2 x WIDTH tokens' top 4, 9-bit ids and fp16 values; an ask: its ids in the
    # bits of its largest (protocol 1: 4 bytes an id)
    answers = 10 * ((2 * WIDTH * 4 * 9 + 7) // 8 + 2 * WIDTH * 4 * 2)
    asks = sum((2 * WIDTH * int(b["input_ids"].max()).bit_length() + 7) // 8 for b in data)
    assert asks <= 10 * (2 * WIDTH * 9 + 7) // 8
    assert stats.wire_bytes == answers + asks
    assert stats.bytes_per_token == (answers + asks) / (10 * 2 * WIDTH)
    assert loader.client.outstanding() == 0


def test_sampled_labels_cross_as_ids_only_and_the_same_tokens_draw_the_same_labels(
        tmp_path: Path) -> None:
    """`distill.labels: sampled` (values "draws"): every batch's labels are K tokens drawn from
    the teacher's distribution, seeded by the batch's tokens (a batch asked twice, as after a
    resume, gets the same labels); only the ids cross (9 bits each here), no values."""
    pki, port = job_pki(tmp_path / "pki"), free_port()
    data = batches(4) + batches(1)  # the fifth batch repeats the first
    with serving_teacher(pki, port, teacher_model(), values="draws", topk=16):
        loader = soft_labelled(data, config=student_cfg(pki, port, values="draws", topk=16,
                                                        lookahead=2))
        try:
            seen = list(loader)
        finally:
            loader.client.close()
    for _, soft in seen:
        assert soft is not None and soft.ids.shape == (2, WIDTH, 16)
        p = soft.logp.exp()
        assert torch.allclose(p.sum(-1), torch.ones(2, WIDTH))  # whole draws, nothing left out
        assert torch.equal(torch.round(p * 16), p * 16)  # each worth times drawn / 16
    assert torch.equal(seen[0][1].ids, seen[4][1].ids) and not torch.equal(seen[0][1].ids,
                                                                           seen[1][1].ids)
    answers = 5 * ((2 * WIDTH * 16 * 9 + 7) // 8)  # 9-bit ids, nothing else
    asks = sum((2 * WIDTH * int(b["input_ids"].max()).bit_length() + 7) // 8 for b in data)
    assert loader.stats.wire_bytes == answers + asks


def test_drawn_labels_estimate_the_teachers_distribution_without_bias() -> None:
    """Many draws' frequencies meet the teacher's probabilities (a top k would leave the tail
    out); on drawn labels the loss is the KL to the draws' distribution, whose gradient
    averages, over draws, to the full KL's."""
    torch.manual_seed(4)
    teacher_logits, student = torch.randn(1, 3, 7), torch.randn(1, 3, 7, requires_grad=True)
    t = 1.5
    p = F.softmax(teacher_logits.reshape(3, 7) / t, -1)
    gen = torch.Generator().manual_seed(0)
    draws = sampled_labels(teacher_logits, 20000, t, gen)
    freq = torch.zeros(3, 7).scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float))
    assert torch.allclose(freq / 20000, p, atol=0.015)
    full_ids, full_logp = topk_labels(teacher_logits, 7, t)
    full = SoftLabels(full_ids.reshape(1, 3, 7), full_logp.reshape(1, 3, 7), "lab")
    kd_full = kd_loss(student, None, full, temperature=t, alpha=1.0)[1]
    (want,) = torch.autograd.grad(kd_full, student)
    grads = []
    for _ in range(400):
        lab = from_draws(sampled_labels(teacher_logits, 8, t, gen).numpy())
        soft = SoftLabels(torch.from_numpy(lab.ids).reshape(1, 3, 8),
                          torch.from_numpy(lab.logp).reshape(1, 3, 8), "lab")
        _, kd, _ = kd_loss(student, None, soft, temperature=t, alpha=1.0)
        empirical = torch.from_numpy(lab.logp).exp()
        q = F.log_softmax(student.detach().reshape(3, 7) / t, -1).gather(
            -1, torch.from_numpy(lab.ids))
        exact = (empirical * (torch.from_numpy(lab.logp) - q)).sum(-1).mean()
        assert torch.allclose(kd, exact, atol=1e-5)  # padding slots (p = 0) count nothing
        grads.append(torch.autograd.grad(kd, student)[0])
    mean = torch.stack(grads).mean(0)
    assert (mean - want).abs().max() < 0.1 * want.abs().max()


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
