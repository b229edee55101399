"""A student rank for the distillation end-to-end test and bench: a small GPT-2 trained on
token batches with `runtime.distill` (soft labels from the job's teacher, `kd_loss`), data
parallel over gloo (gradients averaged with all_reduce), its result written as JSON.

``python -m helpers.distill_student OUT STEPS`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and NEBULA_DISTILL_CONFIG set; DISTILL_DATA names a .pt of token ids
(sequences, width) to train on (each rank takes every WORLD_SIZE-th batch of 4 sequences),
DISTILL_EVAL one to measure the eval loss on, DISTILL_HARD=1 trains on hard labels only,
DISTILL_STEP_S=s makes each step last s seconds more (a slower student, for fault tests),
DISTILL_ON_POLICY=1 trains on-policy (`distill.mode: on_policy`: the first half of each
sequence is a prompt the student continues with `generate`, the teacher scores the samples),
DISTILL_CKPT=dir saves the rank's model, optimizer and step there every 5 steps and, when one is
there at the start, resumes from it (the loader's first ask numbered by that step).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV, DistillConfig
from nebula_cli.runtime.distill import kd_loss, on_policy, on_policy_loss, soft_labelled
from nebula_cli.runtime.distill.on_policy import own_samples

BATCH = 4


def student(vocab: int, width: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=width, n_embd=64,
                                      n_layer=2, n_head=2))


def save(model: GPT2LMHeadModel, opt: torch.optim.Optimizer, ckpt: str, rank: int,
         step: int) -> None:
    os.makedirs(ckpt, exist_ok=True)
    path = f"{ckpt}/rank{rank}-step{step}.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def saved_steps(ckpt: str | os.PathLike[str], rank: int) -> list[int]:
    """The steps ``rank`` saved under ``ckpt`` (`save`'s files; none while being written)."""
    names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
    return [int(p.split("-step")[1][:-3]) for p in names
            if p.startswith(f"rank{rank}-step") and p.endswith(".pt")]


def resume(model: GPT2LMHeadModel, opt: torch.optim.Optimizer, ckpt: str, rank: int) -> int:
    """Load the newest step every rank saved (a stop can land between two ranks' saves); 0 if
    none."""
    newest = torch.tensor(max(saved_steps(ckpt, rank), default=0))
    dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    if newest.item():
        state = torch.load(f"{ckpt}/rank{rank}-step{newest.item()}.pt")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    return int(newest.item())


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    data = torch.load(os.environ["DISTILL_DATA"])
    vocab = int(os.environ["DISTILL_VOCAB"])
    model = student(vocab, data.shape[1])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mine = [data[i:i + BATCH] for i in range(BATCH * rank, BATCH * steps * world, BATCH * world)]
    hard = os.environ.get("DISTILL_HARD") == "1"
    pause = float(os.environ.get("DISTILL_STEP_S") or 0)
    ckpt = os.environ.get("DISTILL_CKPT")
    first = resume(model, opt, ckpt, rank) if ckpt else 0
    cfg = None if hard else DistillConfig.load(os.environ[DISTILL_CONFIG_ENV])
    scored = os.environ.get("DISTILL_ON_POLICY") == "1"
    half = data.shape[1] // 2

    def sample(prompts: torch.Tensor) -> torch.Tensor:  # the student's own continuations
        return own_samples(model, prompts, data.shape[1] - half)

    if cfg is None:
        loader = None
    elif scored:
        loader = on_policy([b[:, :half] for b in mine[first:]], sample, config=cfg,
                           first_seq=first)
    else:
        loader = soft_labelled(mine[first:], config=cfg, first_seq=first)
    t, alpha = (1.0, 0.0) if cfg is None else (cfg.temperature, cfg.alpha)  # hard: CE alone
    kd_first = kd_last = None
    start = time.monotonic()
    step = first
    for batch, soft in (((b, None) for b in mine[first:]) if loader is None else loader):
        if scored:
            logits = model(batch.sequences).logits
            loss, kd, _ = on_policy_loss(logits, batch.sequences, soft, start=batch.start,
                                         alpha=alpha)
        else:
            logits = model(batch).logits
            loss, kd, _ = kd_loss(logits, batch, soft, temperature=t, alpha=alpha)  # the job's
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        step += 1
        if ckpt and step % 5 == 0:
            save(model, opt, ckpt, rank, step)
        time.sleep(pause)
        if kd is not None:
            kd_first = kd.item() if kd_first is None else kd_first
            kd_last = kd.item()
    elapsed = time.monotonic() - start
    evals = os.environ.get("DISTILL_EVAL")
    eval_loss = None
    if evals:
        with torch.no_grad():
            held = torch.load(evals)
            eval_loss = model(held, labels=held).loss.item()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    stats = loader.stats if loader is not None else None
    with open(out, "w") as f:
        json.dump({"rank": rank, "digest": digest, "steps": step, "first_step": first,
                   "batches": stats.batches if stats else None, "elapsed_s": elapsed,
                   "tokens": sum(b.numel() for b in mine), "kd_first": kd_first,
                   "kd_last": kd_last, "eval_loss": eval_loss,
                   "without_labels": stats.without_labels if stats else None,
                   "bytes_per_token": stats.bytes_per_token if stats else None,
                   "ask_bytes": stats.ask_bytes if stats else None,
                   "wire_bytes": stats.wire_bytes if stats else None,
                   "seen_tokens": stats.tokens if stats else None,
                   "longest_wait_s": stats.longest_wait_s if stats else None}, f)
    if loader is not None:
        loader.client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
