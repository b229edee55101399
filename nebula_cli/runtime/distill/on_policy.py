"""On-policy distillation (``distill.mode: on_policy``): the student samples continuations of
its prompts at its own site, and the teacher scores those tokens (its log-probability of each,
2 bytes a token back); `on_policy_loss` trains the student on the reverse KL of its samples
(GKD, MiniLLM; what Thinking Machines and prime-rl call on-policy distillation)::

    loader = distill.on_policy(prompts, sample=lambda p: model.generate(p, do_sample=True,
                                                                         max_new_tokens=32))
    for batch, scores in loader:                    # batch: Sampled
        logits = model(batch.sequences).logits
        loss, rkl, ce = distill.on_policy_loss(logits, batch.sequences, scores,
                                               start=batch.start, alpha=cfg.alpha)

Each batch of prompts is sampled when it is asked for, ``lookahead`` batches before the step
that trains on it (the answer is there when the step needs it): the samples come from a model
at most ``lookahead`` steps older than the one they train (set ``distill.lookahead`` lower for
samples closer to the policy; 0 samples each batch at its own step and waits one teacher round
trip a step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nebula_cli.config.distill_config import DistillConfig
from nebula_cli.runtime.distill.loader import DistillLoader, client_of, job_config

UNBIASED = {"do_sample": True, "top_k": 0, "top_p": 1.0, "temperature": 1.0}
"""A Hugging Face `generate`'s settings that sample from the model's own distribution
(transformers applies a top 50 by default, and a model's generation config may set more): the
reverse KL is estimated on these samples."""

Sampler = Callable[[torch.Tensor], torch.Tensor]
"""Prompts (batch, start) int64 -> the same prompts, each continued by the student's samples
(batch, width > start)."""


def own_samples(model: Any, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``prompts`` continued by exactly ``new_tokens`` of a Hugging Face causal LM's own samples
    (`UNBIASED`; in eval mode, so no dropout in them; its mode restored after), on its
    device: a `Sampler` for `on_policy`."""
    was = model.training
    model.eval()
    try:
        p = prompts.to(next(model.parameters()).device)
        pad = getattr(model.generation_config, "pad_token_id", None)
        return model.generate(p, attention_mask=torch.ones_like(p), **UNBIASED,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0 if pad is None else pad)
    finally:
        model.train(was)


@dataclass(frozen=True)
class Sampled:
    """One batch of the student's own samples: ``sequences`` (batch, width) int64, whose first
    ``start`` tokens of each row are its prompt."""

    sequences: torch.Tensor
    start: int


def _prompts(batch: Any) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        return batch["input_ids"]
    return batch[0]


def sampled(prompts: Iterable[Any], sample: Sampler,
            prompt_ids: Callable[[Any], torch.Tensor] = _prompts) -> Iterator[Sampled]:
    """Each batch of ``prompts`` continued by ``sample`` (run without gradients)."""
    for batch in prompts:
        p = prompt_ids(batch)
        with torch.no_grad():
            seqs = sample(p)
        if seqs.dim() != 2 or seqs.shape[0] != p.shape[0] or seqs.shape[1] <= p.shape[1]:
            raise ValueError(f"the sampler turned prompts of shape {tuple(p.shape)} into "
                             f"{tuple(seqs.shape)}: it must return the prompts, each "
                             "continued by at least one token, as (batch, width) ids")
        if not torch.equal(seqs[:, :p.shape[1]].cpu(), p.cpu()):
            raise ValueError("the sampler's sequences do not begin with their prompts")
        yield Sampled(seqs.detach().to("cpu", torch.long), int(p.shape[1]))


def on_policy(prompts: Iterable[Any], sample: Sampler, config: DistillConfig | None = None,
              rank: int | None = None, *,
              prompt_ids: Callable[[Any], torch.Tensor] = _prompts,
              **kw: Any) -> DistillLoader:
    """Batches of the student's samples of ``prompts`` (`Sampled`), each with the teacher's
    scores of them (`SoftLabels` with ``on_policy``), as the job's distill.json (or ``config``)
    says; ``kw``: `DistillLoader`'s own (``first_seq``); ``prompt_ids``: a batch's prompt ids
    (default: the batch, its ``input_ids`` or its first item)."""
    cfg = job_config(config, on_policy=True)
    return DistillLoader(sampled(prompts, sample, prompt_ids), client_of(cfg, rank),
                         lookahead=cfg.lookahead, when_no_teacher=cfg.when_no_teacher,
                         wait_s=cfg.wait_s, token_ids=lambda b: b.sequences,
                         **{"vocab": cfg.vocab, **kw})
