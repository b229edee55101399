"""Train the small GPT on the bundled corpus with DeepSpeed: the script a nebula job runs.

Run by nebula as ``python -u train.py`` in this directory, one process per slot, with the
usual torch.distributed variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) and NEBULA_* ones.
Also runs by hand: ``python train.py`` (one process) or ``deepspeed --num_gpus 2 train.py``.

- DeepSpeed config: ``--ds-config``, else $NEBULA_DS_CONFIG, else ``ds_config.json`` here.
- Every rank of every cluster builds the model from the same seed (identical initial
  weights); each (cluster, rank) draws its own batches.
- With $NEBULA_SYNC_CONFIG set (a job with a relay), ``nebula_cli.runtime.sync.OuterSync``
  syncs with the other clusters (its round metrics are merged into the logged records).
- Rank 0 of the cluster logs loss, tokens/s and lr every ``--log-every`` steps and
  ``eval_loss`` every ``--eval-every`` steps (``nebula_cli.runtime.log``), and at the end a
  ``final`` record with the eval loss and a sha256 of the fp32 parameters.
- With $NEBULA_DISTILL_CONFIG set (a student cluster of a job with ``distill:``: Nebula-I's
  phase b, ``examples/nebula-i/``), every batch comes with its teachers' soft labels and the
  loss is ``runtime.distill.kd_loss`` at the job's temperature and alpha.
- SIGTERM: the current step finishes, the final record is written, exit status 0.
- The spec's ``checkpoint:``: ``OuterSync.resume()`` loads the cluster's newest checkpoint and
  the loop goes on from its step; ``OuterSync.checkpoint(step)`` saves one every
  ``checkpoint.every`` steps and at the end (the batch sampler starts again from its seed).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import nebula_cli.runtime  # noqa: F401
except ImportError:  # run from a checkout without nebula installed
    sys.path.append(str(HERE.parents[1]))

from data import BatchSampler, eval_batches, evaluate, load_corpus, split_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from optim import ADAMW, MUON, OPTIMIZERS, muon_adamw  # noqa: E402

from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV, DistillConfig  # noqa: E402
from nebula_cli.runtime import log  # noqa: E402


def common_parser(description: str, *, steps: int, eval_batches: int) -> argparse.ArgumentParser:
    """The options train.py and train_pipe.py share (schedule, logging, seed, model shape)."""
    defaults = GPTConfig()
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=int(os.environ.get("NEBULA_STEPS") or steps))
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    p.add_argument("--eval-batches", type=int, default=eval_batches, help="fixed eval batches")
    p.add_argument("--log-every", type=int, default=10, help="steps between metric records")
    p.add_argument("--seed", type=int, default=int(os.environ.get("NEBULA_SEED") or 1234))
    p.add_argument("--ds-config", type=Path, default=None, help="DeepSpeed config JSON")
    p.add_argument("--d-model", type=int, default=defaults.d_model)
    p.add_argument("--n-layer", type=int, default=defaults.n_layer)
    p.add_argument("--n-head", type=int, default=defaults.n_head)
    p.add_argument("--context", type=int, default=defaults.block_size)
    # The deepspeed launcher passes --local_rank; LOCAL_RANK in the environment is what is used.
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p


def parse_checked(p: argparse.ArgumentParser, argv: list[str] | None,
                  positive: tuple[str, ...] = ()) -> argparse.Namespace:
    """Parse; the schedule options (and `positive`) must be at least 1."""
    args = p.parse_args(argv)
    for name in ("steps", "eval_every", "eval_batches", "log_every", *positive):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common_parser(__doc__.splitlines()[0], steps=300, eval_batches=8)
    p.add_argument("--slowdown", type=float, default=float(os.environ.get("GPT_SLOWDOWN") or 1),
                   help="emulate a slower cluster (benchmarks): after each step, wait "
                        "(SLOWDOWN - 1) times that step's compute time (default $GPT_SLOWDOWN, 1)")
    p.add_argument("--cpus", default=os.environ.get("GPT_CPUS") or None,
                   help="run on these CPUs only, e.g. 0 or 0,1 (benchmarks that give each "
                        "cluster its own cores; default $GPT_CPUS, all)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=ADAMW,
                   help="adamw: the DeepSpeed config's; muon: Muon on the blocks' weight "
                        "matrices, AdamW (the config's settings) on the rest (optim.py; ZeRO 0 "
                        "only)")
    args = parse_checked(p, argv)
    if args.slowdown < 1:
        p.error("--slowdown must be at least 1")
    return args


class StopFlag:
    """Set by SIGTERM; a second SIGTERM falls back to the default action."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """Let ``python train.py`` run alone, without a launcher."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))


def set_threads() -> None:
    """Share the cores this process may use among the processes on this host unless
    OMP_NUM_THREADS says otherwise."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    local = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or "1"
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, int(local))))


def load_ds_config(path: Path | None) -> dict[str, Any]:
    path = path or Path(os.environ.get("NEBULA_DS_CONFIG") or HERE / "ds_config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def optimizer_args(args: argparse.Namespace, model: torch.nn.Module) -> dict[str, Any]:
    """deepspeed.initialize's config and optimizer: the config's own, or Muon with AdamW at
    the config's AdamW settings (the config's optimizer then removed: DeepSpeed takes one)."""
    config = load_ds_config(args.ds_config)
    if args.optimizer != MUON:
        return {"config": config, "model_parameters": model.parameters()}
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage:
        raise SystemExit(f"--optimizer muon needs ZeRO stage 0 (the config has {stage}): ZeRO "
                         "partitions the weights into flat buffers, where Muon finds no matrix")
    given = config.pop("optimizer", None) or {}
    if given.get("type", "").lower() != "adamw" or "lr" not in given.get("params", {}):
        raise SystemExit(f"--optimizer muon takes the AdamW settings of the DeepSpeed config's "
                         f"optimizer (type AdamW, params with lr); the config has "
                         f"{given or 'none'}")
    return {"config": config, "optimizer": muon_adamw(model, given["params"])}


def param_checksum(engine: Any) -> str:
    """sha256 of every parameter's fp32 bytes, in name order (a collective under ZeRO-3)."""
    zero = engine.zero_optimization_stage() > 0
    h = hashlib.sha256()
    for _, p in sorted(engine.module.named_parameters(), key=lambda kv: kv[0]):
        full = deepspeed.utils.safe_get_full_fp32_param(p) if zero else p.data
        h.update(full.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def all_reduce_values(values: list[float], device: torch.device, op: Any = None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


class SoftBatches:
    """The sampler's batches with the job's teachers' soft labels (`runtime.distill`), and the
    distillation loss of the next one (`kd_loss` at the job's temperature and alpha; the
    targets are the next bytes already: no shift)."""

    def __init__(self, sampler: BatchSampler, batches: int, first: int) -> None:
        from nebula_cli.runtime import distill

        self.cfg = DistillConfig.load(os.environ[DISTILL_CONFIG_ENV])
        self.kd_loss = distill.kd_loss
        source = (sampler.next() for _ in range(batches))
        self.loader = distill.soft_labelled(source, config=self.cfg, token_ids=lambda b: b[0],
                                            first_seq=first)
        self.batches = iter(self.loader)

    def loss(self, engine: Any, device: torch.device) -> torch.Tensor:
        (x, y), soft = next(self.batches)
        logits, _ = engine(x.to(device))
        if soft is not None:
            soft = dataclasses.replace(soft, ids=soft.ids.to(device), logp=soft.logp.to(device))
        loss, _, _ = self.kd_loss(logits, y.to(device), soft, temperature=self.cfg.temperature,
                                  alpha=self.cfg.alpha, shift=False)
        return loss

    def close(self) -> None:
        self.loader.report()  # the figures of the batches since the last record
        self.loader.client.close()


def distilled(sampler: BatchSampler, batches: int, first: int) -> SoftBatches | None:
    """Soft-labelled batches in a student cluster of a job with `distill:` (None elsewhere)."""
    if not os.environ.get(DISTILL_CONFIG_ENV):
        return None
    return SoftBatches(sampler, batches, first)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = StopFlag()
    signal.signal(signal.SIGTERM, stop)
    single_process_env()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    set_threads()

    on_cpu = get_accelerator().device_name() == "cpu"
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    cluster_index = int(os.environ.get("NEBULA_CLUSTER_INDEX") or 0)
    lead = rank == 0

    cfg = GPTConfig(
        block_size=args.context, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model
    )
    torch.manual_seed(args.seed)  # same initial weights on every rank of every cluster
    model = GPT(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, **optimizer_args(args, model))
    device = engine.device
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    split = split_corpus(load_corpus())
    sampler = BatchSampler(
        split.train, micro, cfg.block_size, seed=args.seed, rank=rank, cluster=cluster_index
    )
    held_out = eval_batches(split.eval, args.eval_batches, micro, cfg.block_size, seed=args.seed)

    sync = None
    from nebula_cli.runtime import sync as outer

    if outer.wanted():  # in a job with a relay, or in `nebula plan`'s dry run
        sync = outer.OuterSync(engine)
    # the spec's `checkpoint:`: the newest checkpoint of the cluster, if any (0: none)
    start = sync.resume() if sync is not None else 0

    if lead:
        print(
            f"gpt: {model.num_params():,} parameters, {world} rank(s) "
            f"(ZeRO {engine.zero_optimization_stage()}), micro batch {micro} x "
            f"{accum} accum x {cfg.block_size} tokens, {len(split.train):,} train / "
            f"{len(split.eval):,} eval bytes, {args.steps} steps",
            flush=True,
        )

    # a student cluster of a job with `distill:` (Nebula-I's phase b): each batch comes with
    # its teacher's soft labels, asked `lookahead` batches ahead; the loss is kd_loss
    soft_batches = distilled(sampler, (args.steps - start) * accum, first=start * accum)

    tokens_per_step = micro * accum * cfg.block_size * world
    first_loss = last_loss = eval_loss = float("nan")
    window_loss, window_steps = 0.0, 0
    t_start = t_window = time.perf_counter()
    t_first_step = None
    step = start
    stopping = False  # (resumed at its last step, from a checkpoint made before its end: no
    try:  # step is left, and the round over the steps since the last one is still owed)
        for step in range(start + 1, args.steps + 1):
            step_loss = 0.0
            info: dict[str, Any] = {}
            t_step = time.perf_counter()
            for _ in range(accum):
                if soft_batches is None:
                    x, y = sampler.next()
                    _, loss = engine(x.to(device), y.to(device))
                else:
                    loss = soft_batches.loss(engine, device)
                engine.backward(loss)
                if sync is not None:  # gradient mode averages gradients across clusters here
                    info.update(sync.after_backward() or {})
                engine.step()
                step_loss += loss.item() / accum
            if args.slowdown > 1:  # a slower cluster, honestly: each step takes F times as long
                time.sleep((args.slowdown - 1) * (time.perf_counter() - t_step))
            if sync is not None:  # DiLoCo mode: an outer round every few steps
                info.update(sync.after_step(step) or {})
                sync.checkpoint(step)  # every checkpoint.every steps (the spec's)
            window_loss += step_loss
            window_steps += 1
            if t_first_step is None:
                t_first_step = time.perf_counter()
            # Every rank must agree on stopping, or the others would wait in a collective.
            stopping = all_reduce_values([float(stop.requested)], device, dist.ReduceOp.MAX)[0] > 0
            last = stopping or step == args.steps
            record: dict[str, Any] = {}
            if step == 1 or step % args.log_every == 0 or last:
                total, steps_seen = all_reduce_values([window_loss, float(window_steps)], device)
                now = time.perf_counter()
                last_loss = total / (steps_seen or 1)
                if step == 1:
                    first_loss = last_loss
                record.update(
                    loss=last_loss,
                    tokens_per_s=tokens_per_step * window_steps / max(now - t_window, 1e-9),
                    lr=engine.get_lr()[0],
                )
                window_loss, window_steps = 0.0, 0
            if step % args.eval_every == 0 or last:
                eval_loss = evaluate(engine, held_out, device)
                record["eval_loss"] = eval_loss
            if info:
                record.update(info)
            if lead and record:
                log(step=step, **record)
            if "loss" in record:
                t_window = time.perf_counter()  # the next window leaves out eval and logging
            if stopping:
                if lead:
                    print(f"gpt: SIGTERM, stopped after step {step}", flush=True)
                break
        t_loop = time.perf_counter()
        if soft_batches is not None:
            soft_batches.close()
        if sync is not None:  # the round in flight, a last one over the steps since the last
            # boundary, then the state every cluster ends with (a SIGTERM ends the wait for it)
            flushed = sync.finish(agree=not stopping, stop=lambda: stop.requested)
            sync.checkpoint(step, final=True)
            if flushed is not None:  # the same on every rank
                eval_loss = evaluate(engine, held_out, device)
            if lead and flushed:
                log(step=step, eval_loss=eval_loss, **flushed)
        elapsed = time.perf_counter() - t_start
        checksum = param_checksum(engine)
        per_step = (t_loop - (t_first_step or t_start)) / max(step - 1, 1)
        # every rank reports its parameters' checksum: all workers must end identical
        log(
            step=step,
            final=True,
            eval_loss=eval_loss,
            param_sha256=checksum,
            world_size=world,  # the rank is the record's tag; these say where it ran
            local_rank=int(os.environ.get("LOCAL_RANK") or 0),
            first_loss=first_loss,
            last_loss=last_loss,
            s_per_step=per_step,
            elapsed_s=elapsed,
        )
        if lead:
            print(
                f"gpt: final step={step} eval_loss={eval_loss:.4f} first_loss={first_loss:.4f} "
                f"last_loss={last_loss:.4f} s/step={per_step:.3f} elapsed={elapsed:.1f}s "
                f"param_sha256={checksum}",
                flush=True,
            )
    finally:
        if sync is not None:
            sync.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
