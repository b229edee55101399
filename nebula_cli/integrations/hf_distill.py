"""Distillation in a Hugging Face Trainer script, by naming one class (issue 24's Trainer path):

    from nebula_cli.integrations.hf_distill import DistillTrainer as Trainer

:class:`DistillTrainer` is a ``transformers.Trainer`` whose training batches come with the job's
teachers' sparse soft labels (``runtime.distill.soft_labelled`` around the Trainer's own
training dataloader: ``lookahead`` batches asked ahead, ``when_no_teacher`` followed) and whose
training loss is ``runtime.distill.kd_loss``: KL at the job's temperature on the teacher's top k,
mixed with the model's hard-label loss by ``distill.alpha`` (a batch without soft labels, under
``ce_only``, trains on the hard labels alone). Evaluation and prediction are the Trainer's own.

The settings are the job's distill.json (``NEBULA_DISTILL_CONFIG``, written by nebula for a
student cluster of a job with ``distill:``), or ``distill_config=``. Without either it is the
plain Trainer. The model is a causal LM: position t's soft labels are the teacher's for the
same position, and the hard labels are shifted as the model's own loss shifts them. Needs the
``hf`` extra (transformers).

In a job with ``distill.mode: on_policy`` each training batch's first ``on_policy_prompt``
tokens (default: half its width) are a prompt the model continues with its own samples
(``generate`` with ``do_sample`` and no top k, top p or temperature: from the model's own
distribution, in eval mode, up to the batch's width: the teacher runs as
many tokens as off-policy), which the teacher scores; the loss is
``runtime.distill.on_policy_loss`` (the prompts' cross entropy mixed in by ``alpha``). Its
batches must be unpadded (an attention mask of ones: packed or fixed-length texts).

``resume_from_checkpoint`` in the middle of an epoch: the Trainer skips the epoch's batches
already trained with accelerate's ``skip_first_batches``, which rebuilds a plain DataLoader. This
module routes that call (the name ``transformers.trainer.skip_first_batches``, set when it is
imported; any other dataloader goes to accelerate's unchanged) to
`SoftLabelledBatches.skipped`: the same skip, then soft labels asked for the batches from there,
numbered from the first one trained. None is skipped twice or trained without its labels.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import transformers.trainer
from transformers import Trainer

from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV, DistillConfig
from nebula_cli.relay.distill.sparse import Values
from nebula_cli.runtime.distill import (
    DistillLoader,
    Sampled,
    SoftLabels,
    kd_loss,
    on_policy,
    on_policy_loss,
    soft_labelled,
)
from nebula_cli.runtime.distill.loader import DistillError
from nebula_cli.runtime.distill.on_policy import own_samples

SOFT_KEY = "nebula_soft_labels"
"""Where a training batch carries its soft labels from the dataloader to ``compute_loss``."""
START_KEY = "nebula_prompt_tokens"
"""On-policy: where a batch of samples carries its prompts' length to ``compute_loss``."""


def is_on_policy(config: DistillConfig) -> bool:
    return Values(config.values) is Values.TOKEN


class SoftLabelledBatches:
    """The Trainer's training dataloader, each batch (a mapping) with its soft labels under
    :data:`SOFT_KEY`; everything else (``len``, ``set_epoch``, ``sampler``, ...) is the
    dataloader's."""

    def __init__(self, dataloader: Any, loader: DistillLoader, config: DistillConfig,
                 make: Any = None) -> None:
        """``make(dataloader, first_seq)``: the loader of a dataloader (`skipped`'s); default
        `soft_labelled`."""
        self.dataloader, self.loader, self.config = dataloader, loader, config
        self.make = make or (lambda d, first: soft_labelled(d, config=config, first_seq=first))
        self.skips: list[SoftLabelledBatches] = []
        """What `skipped` made (a resumed epoch's batches): closed with this one."""

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataloader, name)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch, soft in self.loader:
            if isinstance(batch, Sampled):  # on-policy: the model's own samples
                yield {"input_ids": batch.sequences,
                       "attention_mask": torch.ones_like(batch.sequences), SOFT_KEY: soft,
                       START_KEY: batch.start}
            else:
                yield {**batch, SOFT_KEY: soft}

    def skipped(self, num_batches: int) -> SoftLabelledBatches:
        """The batches after the first ``num_batches`` (accelerate's skip, as the Trainer's
        own), with their soft labels; this one is left whole for the epochs after."""
        rest = _accelerate_skip(self.dataloader, num_batches)
        skip = SoftLabelledBatches(rest, self.make(rest, num_batches), self.config, self.make)
        self.skips.append(skip)
        return skip

    def close(self) -> None:
        for batches in (self, *self.skips):
            batches.loader.client.close()


_accelerate_skip = transformers.trainer.skip_first_batches


def _skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """The Trainer's skip of a resumed epoch's trained batches (see the module docstring)."""
    if isinstance(dataloader, SoftLabelledBatches):
        return dataloader.skipped(num_batches)
    return _accelerate_skip(dataloader, num_batches)


transformers.trainer.skip_first_batches = _skip_first_batches


class DistillTrainer(Trainer):  # type: ignore[misc]
    """A Trainer that distils from the job's teachers (see the module docstring)."""

    def __init__(self, *args: Any, distill_config: DistillConfig | None = None,
                 on_policy_prompt: int | None = None, **kwargs: Any) -> None:
        """``on_policy_prompt``: on-policy, the prompt's tokens of each batch (default: half
        its width)."""
        super().__init__(*args, **kwargs)
        self.on_policy_prompt = on_policy_prompt
        path = os.environ.get(DISTILL_CONFIG_ENV)
        self.distill_config = distill_config or (DistillConfig.load(path) if path else None)
        if self.distill_config is not None and self.distill_config.teacher:
            raise ValueError(f"cluster {self.distill_config.cluster} is a teacher: it serves "
                             "soft labels (nebula_cli.runtime.distill.serve), it does not "
                             "train a student")
        self.soft_batches: SoftLabelledBatches | None = None
        """The training batches with their soft labels (``.loader.stats``: what came)."""
        if self.distill_config is not None:
            # kd_loss is a mean over the batch: the Trainer divides it by the accumulation
            # steps itself only when the model is not handed `num_items_in_batch`
            self.model_accepts_loss_kwargs = False

    def get_train_dataloader(self) -> Any:
        dataloader = super().get_train_dataloader()
        if self.distill_config is None:
            return dataloader
        self._close_labels()
        cfg = self.distill_config
        if is_on_policy(cfg):
            def make(d: Any, first: int) -> DistillLoader:
                return on_policy(d, self._sample, config=cfg, prompt_ids=self._prompts,
                                 first_seq=first)
        else:
            def make(d: Any, first: int) -> DistillLoader:
                return soft_labelled(d, config=cfg, first_seq=first)
        self.soft_batches = SoftLabelledBatches(dataloader, make(dataloader, 0), cfg, make)
        return self.soft_batches

    def _prompts(self, batch: dict[str, Any]) -> torch.Tensor:
        """On-policy: a batch's prompts (its first ``on_policy_prompt`` tokens); the width to
        sample to is the batch's."""
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise DistillError("on-policy distillation samples after unpadded prompts: this "
                               "batch is padded (its attention mask has zeros); train on "
                               "packed or fixed-length texts")
        start = self.on_policy_prompt or ids.shape[1] // 2
        if not 1 <= start < ids.shape[1]:
            raise DistillError(f"on_policy_prompt {start} in batches of {ids.shape[1]} tokens: "
                               "a prompt must leave room for one sampled token")
        self._width = int(ids.shape[1])
        return ids[:, :start]

    def _sample(self, prompts: torch.Tensor) -> torch.Tensor:
        """The model's own continuations of ``prompts`` to the batch's width (eval mode: no
        dropout in the samples)."""
        return own_samples(self.accelerator.unwrap_model(self.model), prompts,
                           self._width - prompts.shape[1])

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     **kwargs: Any) -> Any:
        if SOFT_KEY not in inputs:  # evaluation, or no distillation
            if self.distill_config is not None and model.training:
                raise DistillError(
                    "a training batch came without the soft labels' slot: something replaced "
                    "the training dataloader DistillTrainer.get_train_dataloader made "
                    "(transformers.trainer.skip_first_batches, set by "
                    "nebula_cli.integrations.hf_distill, was replaced again?)")
            return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        inputs = dict(inputs)
        soft: SoftLabels | None = inputs.pop(SOFT_KEY)
        start = inputs.pop(START_KEY, None)
        labels = inputs.pop("labels", None)
        outputs = model(**inputs)
        logits = outputs["logits"]
        if soft is not None:
            soft = replace(soft, ids=soft.ids.to(logits.device), logp=soft.logp.to(logits.device))
        cfg = self.distill_config
        assert cfg is not None
        if start is not None:
            loss, _, _ = on_policy_loss(logits, inputs["input_ids"], soft, start=start,
                                        alpha=cfg.alpha)
        else:
            loss, _, _ = kd_loss(logits, labels, soft, temperature=cfg.temperature,
                                 alpha=cfg.alpha)
        return (loss, outputs) if return_outputs else loss

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            self._close_labels()

    def _close_labels(self) -> None:
        if self.soft_batches is not None:
            self.soft_batches.close()
