"""`kd_loss` (runtime/distill/loss.py) against soft labels of another vocabulary: a teacher's
id beyond the student's vocabulary is refused naming both (a gather would index past the
student's logits); a larger teacher vocabulary whose ids all fit is taken."""

from __future__ import annotations

import pytest
import torch

from nebula_cli.runtime.distill.loader import SoftLabels
from nebula_cli.runtime.distill.loss import kd_loss

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
