"""`kd_loss` (runtime/distill/loss.py) against soft labels of another vocabulary: a teacher's
id beyond the student's vocabulary is refused naming both (a gather would index past the
student's logits); a larger teacher vocabulary whose ids all fit is taken."""

from __future__ import annotations

import pytest
import torch

from nebula_cli.runtime.distill.loader import SoftLabels
from nebula_cli.runtime.distill.loss import kd_loss, on_policy_loss

STUDENT = 300


def soft(top: int, vocab: int) -> SoftLabels:
    ids = torch.tensor([[[top, 1]]])
    return SoftLabels(ids, torch.tensor([[[-0.5, -1.5]]]), "lab", vocab=vocab)


def test_a_teachers_id_beyond_the_students_vocabulary_is_refused_naming_both() -> None:
    logits = torch.zeros(1, 1, STUDENT)
    with pytest.raises(ValueError, match=f"token id {STUDENT + 50} from teacher lab's "
                                         f"vocabulary of {STUDENT + 100}; the student's "
                                         f"vocabulary is {STUDENT}"):
        kd_loss(logits, None, soft(STUDENT + 50, STUDENT + 100), temperature=1.0, alpha=1.0)
    loss, kd, _ = kd_loss(logits, None, soft(STUDENT - 1, STUDENT + 100), temperature=1.0,
                          alpha=1.0)
    assert torch.isfinite(loss) and kd is not None and kd > 0


def test_on_policy_loss_follows_the_reverse_kl_gradient_over_the_students_samples() -> None:
    """`on_policy_loss` on tokens drawn from the student: the mean of its gradient over many
    samples is the gradient of KL(student || teacher) computed exactly over the vocabulary (the
    score function's expectation is zero), and its reverse-KL figure estimates that KL."""
    torch.manual_seed(0)
    vocab, n = 6, 40000
    z = torch.randn(vocab, requires_grad=True)  # the student's logits at the one position
    teacher = torch.log_softmax(torch.randn(vocab) * 2, dim=-1)
    q = torch.softmax(z, dim=-1).detach()
    drawn = torch.multinomial(q, n, replacement=True)
    sequences = torch.stack([torch.zeros(n, dtype=torch.long), drawn], dim=1)  # prompt: token 0
    logits = torch.stack([z.expand(n, vocab), torch.zeros(n, vocab)], dim=1)
    scores = torch.stack([teacher[drawn], torch.zeros(n)], dim=1).reshape(n, 2, 1)
    soft = SoftLabels(sequences[..., None], scores, "lab", on_policy=True)
    loss, rkl, ce = on_policy_loss(logits, sequences, soft, start=1)
    assert ce is None  # a prompt of one token: no prompt token to learn
    (grad,) = torch.autograd.grad(loss, z)
    exact_kl = (torch.softmax(z, -1) * (torch.log_softmax(z, -1) - teacher)).sum()
    (exact,) = torch.autograd.grad(exact_kl, z)
    assert torch.allclose(grad, exact, atol=0.03), (grad, exact)
    assert rkl is not None and float(rkl) == pytest.approx(float(exact_kl), abs=0.03)


def test_on_policy_and_off_policy_labels_each_refuse_the_others_loss() -> None:
    logits = torch.zeros(1, 3, STUDENT)
    seqs = torch.tensor([[4, 5, 6]])
    scored = SoftLabels(seqs[..., None], torch.full((1, 3, 1), -1.0), "lab", on_policy=True)
    with pytest.raises(ValueError, match="on_policy_loss, not kd_loss"):
        kd_loss(logits, seqs, scored, temperature=1.0, alpha=1.0)
    with pytest.raises(ValueError, match="train on them with kd_loss"):
        on_policy_loss(logits, seqs, soft(1, STUDENT), start=1)
    with pytest.raises(ValueError, match="at least one sampled token"):
        on_policy_loss(logits, seqs, scored, start=3)
    # no teacher (ce_only): the prompts' own tokens alone; alpha mixes them in with one
    loss, rkl, ce = on_policy_loss(logits, seqs, None, start=2)
    assert rkl is None and ce is not None and float(loss) == pytest.approx(float(ce))
    mixed, rkl, ce = on_policy_loss(logits, seqs, scored, start=2, alpha=0.5)
    assert rkl is not None and ce is not None
    assert float(mixed) == pytest.approx(0.5 * float(rkl) * -torch.log(torch.tensor(
        float(STUDENT))).item() + 0.5 * float(ce), rel=1e-4)
