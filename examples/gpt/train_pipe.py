"""Train the small GPT as a DeepSpeed pipeline: the script a nebula job with
``parallelism: {pipeline_stages: K}`` runs (one DeepSpeed world spanning the clusters).

Run by nebula as ``python -u train_pipe.py`` in this directory, one process per slot. nebula
sets $NEBULA_PIPELINE_STAGES (K) and orders the ranks so that DeepSpeed's pipe/data topology
(rank = stage x replicas + replica) puts every stage of every replica on the device the
placement chose; $NEBULA_DEVICE names this process's device (``cluster/host/slot``).
Also runs by hand: ``deepspeed --num_gpus 2 train_pipe.py --stages 2``.

- The model: embedding, ``--n-layer`` transformer blocks, final norm and head, as a
  ``deepspeed.pipe.PipelineModule`` cut into K stages by parameter count.
- Every replica draws its own batches (seeded by its data-parallel index); every stage of a
  replica draws the same ones (the first stage uses the inputs, the last one the labels).
- Every rank logs once where it landed (``placement`` record: rank, stage, replica, device,
  layers), rank 0 logs loss every ``--log-every`` steps and ``eval_loss`` every
  ``--eval-every`` steps, and every rank a ``final`` record.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import nebula_cli.runtime  # noqa: F401
except ImportError:  # run from a checkout without nebula installed
    sys.path.append(str(HERE.parents[1]))

from data import BatchSampler, eval_batches, load_corpus, split_corpus  # noqa: E402
from model import Block, GPTConfig, init_weights, scale_residual_projections  # noqa: E402
from train import (  # noqa: E402
    StopFlag,
    all_reduce_values,
    common_parser,
    load_ds_config,
    param_checksum,
    parse_checked,
    set_threads,
    single_process_env,
)

from nebula_cli.runtime import log  # noqa: E402


class Embedding(nn.Module):
    """Token and position embeddings: the first layer of the pipeline."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.apply(init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(pos)


class Head(nn.Module):
    """Final layer norm and the projection to byte logits: the last layer of the pipeline."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class PipeBlock(Block):
    """A transformer block with GPT-2's depth-scaled init of its residual projections."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.apply(init_weights)
        scale_residual_projections(self, cfg.n_layer)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_pipeline(cfg: GPTConfig, stages: int) -> PipelineModule:
    layers = [LayerSpec(Embedding, cfg), *(LayerSpec(PipeBlock, cfg) for _ in range(cfg.n_layer)),
              LayerSpec(Head, cfg)]
    return PipelineModule(layers=layers, num_stages=stages, loss_fn=lm_loss,
                          partition_method="parameters", activation_checkpoint_interval=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common_parser(__doc__.splitlines()[0], steps=100, eval_batches=4)
    p.add_argument("--stages", type=int, default=int(os.environ.get("NEBULA_PIPELINE_STAGES")
                                                     or 2), help="pipeline stages (K)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per step (gradient_accumulation_steps; default: the "
                        "config's, at least 2 x stages)")
    return parse_checked(p, argv, ("stages",))


def pipe_config(args: argparse.Namespace, world: int) -> dict:
    """The DeepSpeed config with the batch arithmetic a pipeline needs made consistent."""
    cfg = load_ds_config(args.ds_config)
    if world % args.stages:
        raise SystemExit(f"train_pipe: {world} ranks cannot form {args.stages} equal stages")
    accum = args.micro_batches or max(int(cfg.get("gradient_accumulation_steps", 1)),
                                      2 * args.stages)
    micro = int(cfg.get("train_micro_batch_size_per_gpu", 4))
    cfg.update(gradient_accumulation_steps=accum, train_micro_batch_size_per_gpu=micro,
               train_batch_size=micro * accum * (world // args.stages))
    cfg["zero_optimization"] = {"stage": 0}  # pipelines support ZeRO 0 and 1; keep it simple
    return cfg


def batches(sampler: BatchSampler) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        yield sampler.next()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = StopFlag()
    signal.signal(signal.SIGTERM, stop)
    if "RANK" not in os.environ:  # alone, without a launcher: one stage
        args.stages = 1
    single_process_env()
    set_threads()

    on_cpu = get_accelerator().device_name() == "cpu"
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(block_size=args.context, n_layer=args.n_layer, n_head=args.n_head,
                    d_model=args.d_model)
    ds_config = pipe_config(args, world)
    torch.manual_seed(args.seed)  # every stage builds its layers from the same seed
    model = build_pipeline(cfg, args.stages)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config)
    stage, replica = engine.stage_id, engine.grid.get_data_parallel_id()
    lo, hi = model.parts[stage], model.parts[stage + 1]
    log(step=0, placement=True, stage=stage, replica=replica,
        stages=engine.num_stages, replicas=engine.grid.get_data_parallel_world_size(),
        device=os.environ.get("NEBULA_DEVICE", f"{socket.gethostname()}/{rank}"),
        hostname=socket.gethostname(), layers=[lo, hi],
        params=sum(p.numel() for p in model.parameters()))
    print(f"gpt-pipe: rank {rank} is stage {stage} of {engine.num_stages}, replica {replica}, "
          f"layers {lo}..{hi - 1}, device {os.environ.get('NEBULA_DEVICE', '?')}", flush=True)

    micro = engine.train_micro_batch_size_per_gpu()
    split = split_corpus(load_corpus())
    train_iter = batches(BatchSampler(split.train, micro, cfg.block_size, seed=args.seed,
                                      rank=replica, cluster=0))
    held_out = eval_batches(split.eval, args.eval_batches, micro, cfg.block_size,
                            seed=args.seed)
    tokens_per_step = ds_config["train_batch_size"] * cfg.block_size
    first_loss = last_loss = eval_loss = float("nan")
    t_window = t_start = time.perf_counter()
    t_first_step = None
    window: list[float] = []
    step = 0
    for step in range(1, args.steps + 1):
        loss = float(engine.train_batch(data_iter=train_iter))
        window.append(loss)
        if step == 1:
            first_loss = loss
            t_first_step = time.perf_counter()
        stopping = all_reduce_values([float(stop.requested)], engine.device,
                                     dist.ReduceOp.MAX)[0] > 0
        last = stopping or step == args.steps
        record: dict = {}
        if step == 1 or step % args.log_every == 0 or last:
            now = time.perf_counter()
            last_loss = sum(window) / len(window)
            record.update(loss=last_loss, tokens_per_s=tokens_per_step * len(window)
                          / max(now - t_window, 1e-9))
            window, t_window = [], now
        if step % args.eval_every == 0 or last:
            eval_loss = float(engine.eval_batch(data_iter=iter(held_out),
                                                num_micro_batches=len(held_out)))
            record["eval_loss"] = eval_loss
        if rank == 0 and record:
            log(step=step, **record)
        if last:
            break
    t_loop = time.perf_counter()
    elapsed = t_loop - t_start
    per_step = (t_loop - (t_first_step or t_start)) / max(step - 1, 1)
    # the replicas of one stage must end with identical parameters (data parallel inside it)
    log(step=step, final=True, stage=stage, replica=replica, eval_loss=eval_loss,
        first_loss=first_loss, last_loss=last_loss, s_per_step=per_step, elapsed_s=elapsed,
        param_sha256=param_checksum(engine))
    if rank == 0:
        print(f"gpt-pipe: final step={step} first_loss={first_loss:.4f} "
              f"last_loss={last_loss:.4f} eval_loss={eval_loss:.4f} elapsed={elapsed:.1f}s",
              flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
