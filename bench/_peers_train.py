"""The training work every peer of bench/peers.py does, the same as examples/gpt/train.py's under
nebula: imported by the peers' worker scripts (bench/_peers_torchft.py, bench/_peers_hivemind.py)
inside their own venvs, so it needs only torch and examples/gpt (model.py, data.py).

- `Work.build(...)`: the GPT of examples/gpt from the seed (identical initial weights
  everywhere), the corpus split, the worker's batch stream `BatchSampler(seed, cluster, rank)`
  (the same stream as nebula's worker of that cluster and rank), the 8 held-out eval batches of
  train.py, and the inner optimizer of examples/gpt/ds_config.json as DeepSpeed builds it:
  torch AdamW (lr 0.002, betas 0.9/0.95, eps 1e-8, weight decay 0.01), WarmupLR linear from 0
  over 30 steps with the lr a DeepSpeed engine gives each step (`warmup_factor`: 0 on the
  first two), gradient clipping 1.0.
- `Log`: JSON lines as nebula's metrics (`ts`, `step`, `cluster`, `rank`, and `loss`,
  `eval_loss`, `final`, `param_sha256`, `s_per_step`), so bench/peers.py reads every system's
  records with one function.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GPT_DIR = Path(__file__).resolve().parent.parent / "examples" / "gpt"
sys.path.insert(0, str(GPT_DIR))
from data import BatchSampler, eval_batches, evaluate, load_corpus, split_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

DS_CONFIG = json.loads((GPT_DIR / "ds_config.json").read_text())
CONTEXT = 128
EVAL_BATCHES = 8


def adamw(params: Any) -> torch.optim.Optimizer:
    """examples/gpt/ds_config.json's optimizer (DeepSpeed's torch_adam AdamW)."""
    p = DS_CONFIG["optimizer"]["params"]
    return torch.optim.AdamW(params, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                             weight_decay=p["weight_decay"])


def warmup_factor(step: int) -> float:
    """The share of the optimizer's lr that ds_config.json's WarmupLR (linear from
    warmup_min_lr 0 over warmup_num_steps, then flat) gives optimizer step ``step`` (1-based),
    as a DeepSpeed engine applies it: 0 on the first two steps, then (step - 2) / warmup_num_steps
    (tests/bench/test_peers_train.py reads it off a real engine)."""
    n = DS_CONFIG["scheduler"]["params"]["warmup_num_steps"]
    return min(1.0, max(0, step - 2) / n)


def warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """DeepSpeed's warmup (``warmup_factor``) for a torch optimizer: a LambdaLR stepped after
    each optimizer step (its k is the number of steps made, so step k + 1's lr)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: warmup_factor(k + 1))


def clip(model: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), DS_CONFIG["gradient_clipping"])


@dataclass
class Work:
    """One worker's model, data and evaluation."""

    model: GPT
    sampler: BatchSampler
    held_out: list[tuple[torch.Tensor, torch.Tensor]]
    tokens_per_step: int

    @classmethod
    def build(cls, *, seed: int, cluster: int, rank: int, micro_batch: int) -> Work:
        torch.manual_seed(seed)  # same initial weights on every worker, as train.py
        model = GPT(GPTConfig(block_size=CONTEXT))
        split = split_corpus(load_corpus())
        sampler = BatchSampler(split.train, micro_batch, CONTEXT, seed=seed, rank=rank,
                               cluster=cluster)
        held = eval_batches(split.eval, EVAL_BATCHES, micro_batch, CONTEXT, seed=seed)
        return cls(model, sampler, held, micro_batch * CONTEXT)

    def loss(self, forward: Any) -> torch.Tensor:
        """The loss of the next batch through `forward` (the model, or a wrapper of it)."""
        x, y = self.sampler.next()
        return forward(x, y)[1]

    def evaluate(self) -> float:
        return evaluate(self.model, self.held_out)

    def checksum(self) -> str:
        """sha256 of the fp32 parameters in name order (train.py's param_checksum)."""
        h = hashlib.sha256()
        for _, p in sorted(self.model.named_parameters(), key=lambda kv: kv[0]):
            h.update(p.detach().float().contiguous().numpy().tobytes())
        return h.hexdigest()


class Log:
    """Metric records as JSON lines in `path` (one writer per file)."""

    def __init__(self, path: Path, *, cluster: int, rank: int) -> None:
        self.path, self.cluster, self.rank = path, cluster, rank
        self.t_first: float | None = None

    def __call__(self, step: int, **values: Any) -> None:
        rec = {"ts": time.time(), "step": step, "cluster": self.cluster, "rank": self.rank}
        rec.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in values.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def step_done(self, step: int) -> None:
        """Mark the end of step 1 (the s_per_step clock starts there, as train.py's)."""
        if step == 1:
            self.t_first = time.perf_counter()

    def s_per_step(self, steps: int) -> float:
        assert self.t_first is not None
        return (time.perf_counter() - self.t_first) / max(steps - 1, 1)
