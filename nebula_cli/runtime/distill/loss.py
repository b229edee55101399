"""The distillation loss on sparse soft labels, and the teacher's labels: its top k, or k
tokens drawn from its distribution.

With the teacher's top k ids ``i`` and log-probabilities at temperature T (``p``, over the
whole vocabulary as the teacher sent them), and the student's log-softmax at T (``log q``,
over the whole vocabulary)::

    KD  = sum_i p_i (log p_i - log q_i) + p_r (log p_r - log q_r)   per token, averaged
    loss = alpha * T^2 * KD + (1 - alpha) * CE(student logits, hard labels)

where ``p_r = 1 - sum_i p_i`` and ``q_r = 1 - sum_i q_i`` are the mass outside the teacher's
top k: one more bucket, so that the student is not taught to put all its mass on the k ids.
(Renormalising ``p`` over the k instead, as a first version did, made a student at V=2048,
k=32, T=2 end worse than training on the hard labels alone: bench/distill.py, 2026-11-27.)

KD is the forward KL(teacher || student) that TRL's GKD computes with ``beta = 0``
(``F.kl_div(student_log_probs, teacher_log_probs, log_target=True)`` summed over the
vocabulary, averaged over the tokens whose label is not ``ignore_index``), restricted to the
teacher's top k; T^2 keeps the gradient's scale independent of T (Hinton et al. 2015; GKD
leaves it out). With k = vocabulary size it is the full KL. Drawn labels (``p_i`` = times
drawn / k, summing to 1) leave no mass outside: KD is then the KL to the draws' distribution,
whose gradient is, in expectation over the draws, the full KL's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from nebula_cli.runtime.distill.loader import SoftLabels

IGNORE_INDEX = -100
_TINY = 1e-12


def topk_labels(logits: torch.Tensor, k: int, temperature: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher's top ``k`` (ids, log-probabilities at ``temperature``) of every position of
    ``logits`` (..., vocab), as (positions, k) int64 and float32, highest first."""
    logp = F.log_softmax(logits.float().reshape(-1, logits.shape[-1]) / temperature, dim=-1)
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return ids, values


def sampled_labels(logits: torch.Tensor, k: int, temperature: float,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """``k`` tokens drawn with repeats from the teacher's distribution at ``temperature`` for
    every position of ``logits`` (..., vocab), as (positions, k) int64: the labels of
    ``distill.labels: sampled`` (`relay.distill.sparse.from_draws` makes them probabilities)."""
    p = F.softmax(logits.float().reshape(-1, logits.shape[-1]) / temperature, dim=-1)
    return torch.multinomial(p, k, replacement=True, generator=generator)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float
                   ) -> torch.Tensor:
    """A teacher's log-probability at ``temperature`` of each sequence's next token, at every
    position of ``logits`` (sequences, width, vocab) for ``tokens`` (sequences, width), as
    (positions, 1) float32; a sequence's last position (no next token) says 0: the labels of
    ``distill.mode: on_policy``, where ``tokens`` are the student's own samples."""
    sequences, width, vocab = logits.shape
    out = torch.zeros(sequences, width, dtype=torch.float32, device=logits.device)
    rows = max(1, (1 << 24) // max(1, width * vocab))  # a log-softmax of a few at once
    for i in range(0, sequences, rows):
        logp = F.log_softmax(logits[i:i + rows, :-1].float() / temperature, dim=-1)
        out[i:i + rows, :-1] = logp.gather(-1, tokens[i:i + rows, 1:, None]).squeeze(-1)
    return out.reshape(-1, 1)


def kd_loss(student_logits: torch.Tensor, labels: torch.Tensor | None,
            soft: SoftLabels | None, *, temperature: float, alpha: float,
            ignore_index: int = IGNORE_INDEX, shift: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, kd, ce) for ``student_logits`` (batch, width, vocab).

    ``labels`` (batch, width): the hard labels (None: KD only); with ``shift`` the causal LM
    convention (position t predicts label t+1; the soft labels of position t are the
    teacher's for the same position, so they are not shifted). ``soft`` None (no teacher
    answered, ``when_no_teacher: ce_only``): the hard-label loss alone."""
    vocab = student_logits.shape[-1]
    ce = None
    if labels is not None:
        logits, target = (student_logits[:, :-1], labels[:, 1:]) if shift else (
            student_logits, labels)
        ce = F.cross_entropy(logits.reshape(-1, vocab).float(), target.reshape(-1),
                             ignore_index=ignore_index)
    if soft is None:
        if ce is None:
            raise ValueError("neither hard labels nor soft labels to learn from")
        return ce, None, ce
    if soft.on_policy:
        raise ValueError("these labels score the student's own samples (distill.mode: "
                         "on_policy): train on them with on_policy_loss, not kd_loss")
    if soft.vocab is not None and soft.vocab > vocab and int(soft.ids.max()) >= vocab:
        raise ValueError(f"soft labels with token id {int(soft.ids.max())} from teacher "
                         f"{soft.teacher}'s vocabulary of {soft.vocab}; the student's "
                         f"vocabulary is {vocab}: their tokenizers must be the same")
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    ids = soft.ids.to(student.device)
    log_q = student.gather(-1, ids)
    log_p = soft.logp.to(student.device).float()
    log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True).clamp(min=0.0)  # sum <= 1
    p = log_p.exp()
    per_token = (p * (log_p - log_q)).sum(-1)
    # the teacher's mass outside its top k, against the student's there: one more bucket
    p_rest = (1.0 - p.sum(-1)).clamp(min=0.0)
    # (a slot with p = 0 holds no token: drawn labels' padding, which repeats an id)
    log_q_rest = torch.log((1.0 - (log_q.exp() * (p > 0)).sum(-1)).clamp(min=_TINY))
    per_token = per_token + p_rest * (torch.log(p_rest.clamp(min=_TINY)) - log_q_rest)
    if labels is not None:
        mask = (labels != ignore_index).float()
        kd = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        kd = per_token.mean()
    if soft.stats is not None:  # the loader's figures: status and the report show its mean
        soft.stats.add_kd(kd)
        if ce is not None:
            soft.stats.add_ce(ce)
    kd_term = kd * temperature ** 2
    loss = kd_term if ce is None else alpha * kd_term + (1 - alpha) * ce
    return loss, kd, ce


def on_policy_loss(student_logits: torch.Tensor, sequences: torch.Tensor,
                   soft: SoftLabels | None, *, start: int, alpha: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, reverse KL, ce) for ``student_logits`` (batch, width, vocab) of ``sequences``
    (batch, width): prompts of ``start`` tokens, each continued by the student's own samples,
    which the teacher scored (``soft``: `token_logprobs`, ``distill.mode: on_policy``).

    The distillation term is the reverse KL(student || teacher) of the sampled tokens, as
    on-policy distillation computes it (GKD with beta = 1 on samples; Thinking Machines'
    per-token reverse KL with no discount; MiniLLM): with ``log q`` the student's and ``log p``
    the teacher's log-probability of a sampled token, ``r = log q - log p`` (not
    differentiated) weighs the student's score function, so the gradient of
    ``mean(r * log q)`` is, in expectation over the samples, the gradient of the reverse KL
    (the score function's expectation is zero). ``alpha < 1`` mixes in the cross entropy of
    the prompts' own tokens (hard labels): ``alpha * RKL + (1 - alpha) * CE``; with no teacher
    (``soft`` None: ``when_no_teacher: ce_only``) the prompts' cross entropy alone."""
    batch, width, vocab = student_logits.shape
    if not 1 <= start < width:
        raise ValueError(f"prompts of {start} tokens in sequences of {width}: each sequence "
                         "needs a prompt and at least one sampled token")
    logq_all = F.log_softmax(student_logits[:, :-1].float(), dim=-1)
    target = sequences[:, 1:].to(logq_all.device)
    ce = None
    if start > 1:
        ce = F.nll_loss(logq_all[:, :start - 1].reshape(-1, vocab),
                        target[:, :start - 1].reshape(-1))
    if soft is None:
        if ce is None:
            raise ValueError("no teacher's scores, and prompts of one token: nothing to learn")
        return ce, None, ce
    if not soft.on_policy:
        raise ValueError("these soft labels are a teacher's own (distill.mode: off_policy): "
                         "train on them with kd_loss")
    logq = logq_all[:, start - 1:].gather(-1, target[:, start - 1:, None]).squeeze(-1)
    logp = soft.logp.to(logq.device).float().reshape(batch, width)[:, start - 1:-1]
    r = (logq - logp).detach()
    rkl = r.mean()
    term = (r * logq).mean()
    if soft.stats is not None:
        soft.stats.add_kd(rkl)
        if ce is not None:
            soft.stats.add_ce(ce)
    loss = term if ce is None or alpha >= 1.0 else alpha * term + (1 - alpha) * ce
    return loss, rkl, ce
