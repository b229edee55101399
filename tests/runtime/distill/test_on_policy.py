"""On-policy distillation (`runtime.distill.on_policy`) with a real teacher (`serve` in a
thread: its label relay and serving link on loopback, mutual TLS): the student's samples of
each prompt batch are scored by the teacher (its log-probability of each sampled token, 2 bytes
a token back), each batch once and in order; the loaders refuse the other mode's job; a
sampler that does not continue its prompts is refused; and training on the scores with
`on_policy_loss` brings the student's reverse KL to the teacher down."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.label_teacher import distill_cfg, job_pki, serving_teacher
from helpers.sshd_bed import free_port

from nebula_cli.runtime.distill import on_policy, on_policy_loss, soft_labelled
from nebula_cli.runtime.distill.loader import DistillError
from nebula_cli.runtime.distill.loss import token_logprobs
from nebula_cli.runtime.distill.on_policy import sampled

VOCAB, PROMPT, NEW = 40, 3, 5


def model(seed: int, scale: float = 1.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
    with torch.no_grad():
        m[1].weight.mul_(scale)
    return m


def sampler(student: torch.nn.Module, gen: torch.Generator):
    """Continue each prompt by NEW tokens drawn from ``student`` (a bigram model)."""
    def sample(prompts: torch.Tensor) -> torch.Tensor:
        seqs = prompts
        for _ in range(NEW):
            p = torch.softmax(student(seqs[:, -1]), dim=-1)
            seqs = torch.cat([seqs, torch.multinomial(p, 1, generator=gen)], dim=1)
        return seqs
    return sample


def prompts(n: int, batch: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (batch, PROMPT), generator=g) for _ in range(n)]


def reverse_kl(student: torch.nn.Module, teacher: torch.nn.Module) -> float:
    """KL(student || teacher) of the next token, averaged over every previous token."""
    with torch.no_grad():
        x = torch.arange(VOCAB)
        q, p = torch.log_softmax(student(x), -1), torch.log_softmax(teacher(x), -1)
        return float((q.exp() * (q - p)).sum(-1).mean())


def test_the_teacher_scores_the_students_samples_two_bytes_a_token(tmp_path: Path) -> None:
    pki, port = job_pki(tmp_path / "pki"), free_port()
    teacher, student = model(0, 4.0), model(5)
    cfg = dict(values="token", topk=1)
    with serving_teacher(pki, port, teacher, **cfg):
        with pytest.raises(DistillError, match="distill.mode is on_policy"):
            soft_labelled(prompts(1), config=distill_cfg(pki, "cloud", "s1", teachers={
                "lab": f"127.0.0.1:{port}"}, **cfg))
        loader = on_policy(prompts(6), sampler(student, torch.Generator().manual_seed(2)),
                           config=distill_cfg(pki, "cloud", "s1", lookahead=2,
                                              teachers={"lab": f"127.0.0.1:{port}"}, **cfg))
        try:
            seen = list(loader)
        finally:
            loader.client.close()
    assert len(seen) == 6
    for (batch, scores), asked in zip(seen, prompts(6), strict=True):
        assert batch.start == PROMPT and torch.equal(batch.sequences[:, :PROMPT], asked)
        assert batch.sequences.shape == (4, PROMPT + NEW)
        assert scores is not None and scores.on_policy and scores.teacher == "lab"
        with torch.no_grad():  # the teacher's own log-probability of each sampled next token
            want = token_logprobs(teacher(batch.sequences), batch.sequences, 1.0)
        assert torch.allclose(scores.logp.reshape(-1, 1), want, atol=1e-2)
        assert torch.equal(scores.ids[:, :-1, 0], batch.sequences[:, 1:])
    stats = loader.stats
    tokens = 6 * 4 * (PROMPT + NEW)
    assert stats.tokens == tokens and stats.without_labels == 0
    assert stats.wire_bytes - stats.ask_bytes == 2 * tokens  # fp16 scores, no ids back
    assert stats.ask_bytes <= 6 * (4 * (PROMPT + NEW) * 6 + 7) // 8  # ids of 6 bits up


def test_an_off_policy_job_refuses_the_on_policy_loader_and_a_bad_sampler_is_refused(
        tmp_path: Path) -> None:
    pki = job_pki(tmp_path / "pki")
    with pytest.raises(DistillError, match="distill.mode is off_policy"):
        on_policy(prompts(1), lambda p: p, config=distill_cfg(pki, "cloud", "s1",
                                                               teachers={"lab": "127.0.0.1:1"}))
    with pytest.raises(ValueError, match="continued by at least one token"):
        next(sampled(prompts(1), lambda p: p))
    with pytest.raises(ValueError, match="do not begin with their prompts"):
        next(sampled(prompts(1), lambda p: torch.cat([p + 1, p], dim=1)))


def test_training_on_the_teachers_scores_brings_the_reverse_kl_down(tmp_path: Path) -> None:
    pki, port = job_pki(tmp_path / "pki"), free_port()
    teacher, student = model(0, 4.0), model(5)
    opt = torch.optim.Adam(student.parameters(), lr=0.05)
    before = reverse_kl(student, teacher)
    cfg = dict(values="token", topk=1)
    with serving_teacher(pki, port, teacher, **cfg):
        loader = on_policy(prompts(100, batch=16),
                           sampler(student, torch.Generator().manual_seed(3)),
                           config=distill_cfg(pki, "cloud", "s1", lookahead=1,
                                              teachers={"lab": f"127.0.0.1:{port}"}, **cfg))
        try:
            for batch, scores in loader:
                loss, rkl, _ = on_policy_loss(student(batch.sequences), batch.sequences,
                                              scores, start=batch.start)
                opt.zero_grad()
                loss.backward()
                opt.step()
        finally:
            loader.client.close()
    after = reverse_kl(student, teacher)
    assert after < 0.5 * before, (before, after)
    assert loader.stats.record()["distill_kd"] is not None  # the reverse KL in the figures
