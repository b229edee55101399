"""integrations/hf_distill: a Trainer script distils by naming `DistillTrainer`, against a real
teacher (`runtime.distill.serve` of a peaked GPT-2, its label relay on loopback, mutual TLS):
every training batch comes with the teacher's soft labels and the loss is `kd_loss`; without
`distill:` it is the plain Trainer, loss for loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.label_teacher import distill_cfg, job_pki, peaked_teacher, serving_teacher
from helpers.sshd_bed import free_port
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV, DistillConfig
from nebula_cli.integrations.hf_distill import DistillTrainer
from nebula_cli.runtime.distill.loader import DistillError

VOCAB, WIDTH, STEPS = 256, 16, 6


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (4 * STEPS, WIDTH),
                                 generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2(seed: int, n_embd: int = 32) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=WIDTH, n_embd=n_embd,
                                      n_layer=1, n_head=2))


def args(out: Path, batch: int = 4, accumulate: int = 1) -> TrainingArguments:
    return TrainingArguments(output_dir=str(out), max_steps=STEPS,
                             per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulate, learning_rate=3e-3,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             seed=0, dataloader_num_workers=0)


def trained(tmp_path: Path, name: str, scored: bool = False, **cfg_kw: object
            ) -> tuple[DistillTrainer, DistillConfig]:
    """A DistillTrainer trained on Tokens against a real teacher (a peaked GPT-2 served on
    loopback; ``scored``: an on-policy job's, scoring the samples), and its distill.json
    (``cfg_kw`` its fields)."""
    pki, port = job_pki(tmp_path / "pki"), free_port()
    teacher = peaked_teacher(gpt2(seed=7, n_embd=64)).eval()
    wire: dict[str, object] = {"values": "token", "topk": 1} if scored else {}
    cfg = distill_cfg(pki, "cloud", "s1", teachers={"lab": f"127.0.0.1:{port}"}, **wire,
                      **cfg_kw)
    with serving_teacher(pki, port, lambda ids: teacher(ids).logits, **wire):
        trainer = DistillTrainer(model=gpt2(seed=0), args=args(tmp_path / name),
                                 train_dataset=Tokens(), distill_config=cfg)
        trainer.train()
    return trainer, cfg


def losses(trainer: Trainer) -> list[float]:
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def test_a_trainer_named_distilltrainer_trains_on_its_teachers_soft_labels(
        tmp_path: Path) -> None:
    trainer, _ = trained(tmp_path, "kd", lookahead=2, alpha=1.0,
                         wait_s=60.0)  # the KD term alone: it must fall
    assert trainer.soft_batches is not None
    stats = trainer.soft_batches.loader.stats
    assert stats.batches == STEPS and stats.without_labels == 0, stats
    assert stats.tokens == STEPS * 4 * WIDTH and stats.bytes_per_token > 0
    kd = losses(trainer)
    assert len(kd) == STEPS and kd[-1] < kd[0], kd

    plain = Trainer(model=gpt2(seed=0), args=args(tmp_path / "plain"), train_dataset=Tokens())
    plain.train()
    assert losses(plain)[0] != pytest.approx(kd[0], rel=1e-3)  # a different loss: the KD


def test_gradient_accumulation_gives_the_loss_of_the_whole_batch(tmp_path: Path) -> None:
    """Two micro-batches of 2 accumulated: the logged loss is that of one batch of 4 (kd_loss is
    a mean; the Trainer divides it by the accumulation steps), not twice it."""
    pki, port = job_pki(tmp_path / "pki"), free_port()
    teacher = peaked_teacher(gpt2(seed=7, n_embd=64)).eval()
    cfg = distill_cfg(pki, "cloud", "s1", teachers={"lab": f"127.0.0.1:{port}"}, lookahead=2)
    first = {}
    with serving_teacher(pki, port, lambda ids: teacher(ids).logits):
        for batch, accumulate in ((4, 1), (2, 2)):
            trainer = DistillTrainer(model=gpt2(seed=0),
                                     args=args(tmp_path / f"ga{accumulate}", batch, accumulate),
                                     train_dataset=Tokens(), distill_config=cfg)
            trainer.train()
            first[accumulate] = losses(trainer)[0]
    assert first[2] == pytest.approx(first[1], rel=1e-3), first


def test_without_distill_it_is_the_plain_trainer(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISTILL_CONFIG_ENV, raising=False)
    runs = []
    for cls in (Trainer, DistillTrainer):
        trainer = cls(model=gpt2(seed=0), args=args(tmp_path / cls.__name__),
                      train_dataset=Tokens())
        trainer.train()
        runs.append(losses(trainer))
    assert runs[0] == runs[1] and len(runs[0]) == STEPS
    assert trainer.soft_batches is None


def test_a_teacher_clusters_config_is_refused(tmp_path: Path) -> None:
    pki = job_pki(tmp_path / "pki")
    cfg = distill_cfg(pki, "lab", "t1", teachers={"lab": "127.0.0.1:1"}, listen="127.0.0.1:1")
    with pytest.raises(ValueError, match="cluster lab is a teacher"):
        DistillTrainer(model=gpt2(seed=0), args=args(tmp_path / "t"), train_dataset=Tokens(),
                       distill_config=cfg)


def test_a_resume_in_the_middle_of_an_epoch_trains_the_rest_with_labels_as_if_never_stopped(
        tmp_path: Path) -> None:
    """A checkpoint at step 3 of a 6-step epoch, resumed by a new DistillTrainer: the Trainer's
    skip of the 3 trained batches keeps the soft labels (it used to rebuild a plain DataLoader
    and the run failed), the 3 batches after it are asked for and trained once each, and the
    model ends where the run that never stopped ends."""
    pki, port = job_pki(tmp_path / "pki"), free_port()
    teacher = peaked_teacher(gpt2(seed=7, n_embd=64)).eval()
    cfg = distill_cfg(pki, "cloud", "s1", teachers={"lab": f"127.0.0.1:{port}"}, lookahead=2)

    def trainer(out: Path, **kw: object) -> DistillTrainer:
        a = args(out)
        a.save_strategy, a.save_steps = "steps", 3  # type: ignore[assignment]
        return DistillTrainer(model=gpt2(seed=0), args=a, train_dataset=Tokens(),
                              distill_config=cfg, **kw)

    with serving_teacher(pki, port, lambda ids: teacher(ids).logits):
        whole = trainer(tmp_path / "whole")
        whole.train()
        resumed = trainer(tmp_path / "whole")  # the same output: its checkpoint-3
        resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-3"))
    assert resumed.soft_batches is not None
    (rest,) = resumed.soft_batches.skips
    assert rest.loader.stats.batches == STEPS - 3 and rest.loader.stats.without_labels == 0
    assert resumed.soft_batches.loader.stats.batches == 0  # the whole epoch was not run
    assert resumed.state.global_step == STEPS
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_an_on_policy_job_trains_the_trainer_on_its_own_scored_samples(tmp_path: Path) -> None:
    """`distill.mode: on_policy`: each batch's first half is a prompt the model continues with
    `generate` (to the batch's width), the teacher scores the samples, the loss is
    `on_policy_loss` (its reverse-KL term falls); padded batches are refused."""
    trainer, cfg = trained(tmp_path, "op", scored=True, lookahead=1, alpha=1.0)
    assert trainer.soft_batches is not None
    stats = trainer.soft_batches.loader.stats
    assert stats.batches == STEPS and stats.without_labels == 0, stats
    assert stats.wire_bytes - stats.ask_bytes == 2 * STEPS * 4 * WIDTH  # 2 bytes a token back
    assert len(losses(trainer)) == STEPS  # (kd_loss refuses scores: on_policy_loss ran)

    class Padded(Tokens):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            mask = torch.ones(WIDTH, dtype=torch.long)
            mask[-2:] = 0
            return {**super().__getitem__(i), "attention_mask": mask}

    padded = DistillTrainer(model=gpt2(seed=0), args=args(tmp_path / "pad"),
                            train_dataset=Padded(), distill_config=cfg)
    with pytest.raises(DistillError, match="this batch is padded"):
        padded.train()
