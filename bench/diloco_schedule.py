"""Outer-optimizer settings for a short schedule: flat data parallel against DiLoCo, in one process.

    .venv/bin/python bench/diloco_schedule.py [--steps 200] [--inner-steps H] [--seeds 1234,1,2]
        [--settings 0.7,0.9 0.6,0.5 1.0,0] [--modes sync overlap late] [--tau 3]
        [--codec C] [--density D] [--bits B] [--span 16..4096] [--decays 1,0.95]
        [--optimizer adamw|muon]
        [--workers-per-cluster 2] [--micro-batch 4] [--json]

H and the outer settings default to the codec's schedule in bench/_schedules.py (the same as
bench/wan_training.py's).

The loss side of bench/wan_training.py without processes, relays or links, so that outer
settings can be compared in minutes and over several seeds: the same GPT (examples/gpt), corpus,
optimizer (AdamW 2e-3, betas 0.9/0.95, weight decay 0.01, DeepSpeed's linear WarmupLR over 30
steps, clipping at 1.0), 2 clusters of --workers-per-cluster workers of --micro-batch x 128-token
sequences (2 of 4: bench/wan_training.py; 1 of 16: bench/hetero.py). A world of workers is simulated
by one model stepping on their concatenated micro-batches (the mean of equal-size means is the
mean of the workers' averaged gradients).

  flat      all the workers in one world: the baseline (a) of bench/wan_training.py
  sync      2 clusters, DiLoCo every H steps: delta = theta_global - local, averaged
            (the relay's codec, --codec, with error feedback, its decay each of --decays:
            compression.feedback_decay), nebula's OuterOptimizer
            (Nesterov), every cluster set to theta_global
  overlap   the same, each average applied --tau steps after its boundary on top of the
            progress made meanwhile, on every cluster (nebula's overlapped sync at the step
            the relays agreed)
  late      the same, applied at the next boundary (one round late: overlap_steps >= H)

Prints the final eval loss of each on the same held-out batches and the relative gap to flat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from _peers_train import warmup_factor  # noqa: E402
from _schedules import schedule  # noqa: E402

sys.path.insert(0, str(REPO / "examples" / "gpt"))
sys.path.insert(0, str(REPO))
from data import BatchSampler, eval_batches, evaluate, load_corpus, split_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from optim import ADAMW, MUON, OPTIMIZERS, muon_adamw  # noqa: E402

from nebula_cli.codecs.topk.codec import TopKCodec  # noqa: E402
from nebula_cli.codecs.topk.params import TOPK_SPANS, TopKParams  # noqa: E402
from nebula_cli.config.sections import CompressionSpec  # noqa: E402
from nebula_cli.relay.codecs.feedback import ErrorFeedback  # noqa: E402
from nebula_cli.relay.codecs.registry import KNOWN_CODECS, get_codec  # noqa: E402
from nebula_cli.runtime.sync import OuterOptimizer  # noqa: E402

CONTEXT, LR, CLIP, CLUSTERS = 128, 2e-3, 1.0, 2
EVAL_BATCHES, EVAL_MICRO = 8, 4  # the held-out set, whatever the training batch
JSON_FIELDS = ("loss_gap", "bytes_per_token_reduction", "medians", "runs")
DEFAULT_CODEC: str = CompressionSpec.model_fields["codec"].default


def inner_lr(step: int) -> float:
    """The lr of optimizer step `step` (1-based) under DeepSpeed's WarmupLR (linear from 0)."""
    return LR * warmup_factor(step)


class World:
    """One DeepSpeed world (a cluster): a model, its AdamW, one sampler per worker."""

    def __init__(self, seed: int, split: Any, cluster: int, ranks: int, micro: int,
                 optimizer: str = ADAMW) -> None:
        torch.manual_seed(seed)
        self.model = GPT(GPTConfig(block_size=CONTEXT))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        adamw = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
        self.opt = (muon_adamw(self.model, adamw) if optimizer == MUON
                    else torch.optim.AdamW(self.params, **adamw))
        self.samplers = [BatchSampler(split.train, micro, CONTEXT, seed=seed, rank=r,
                                      cluster=cluster) for r in range(ranks)]
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        xs, ys = zip(*(s.next() for s in self.samplers), strict=True)
        _, loss = self.model(torch.cat(xs), torch.cat(ys))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        for group in self.opt.param_groups:
            group["lr"] = inner_lr(self.steps)
        self.opt.step()

    def read(self) -> torch.Tensor:
        return torch.nn.utils.parameters_to_vector(self.params).detach().clone()

    def write(self, flat: torch.Tensor) -> None:
        torch.nn.utils.vector_to_parameters(flat.clone(), self.params)


def run_flat(args: argparse.Namespace, seed: int, split: Any, held: Any) -> float:
    world = World(seed, split, cluster=0, ranks=CLUSTERS * args.workers_per_cluster,
                  micro=args.micro_batch, optimizer=args.optimizer)
    for _ in range(args.steps):
        world.step()
    return evaluate(world.model, held)


def run_diloco(args: argparse.Namespace, seed: int, split: Any, held: Any, lr: float,
               momentum: float, mode: str, decay: float | None = None) -> dict[str, Any]:
    worlds = [World(seed, split, cluster=c, ranks=args.workers_per_cluster,
                    micro=args.micro_batch, optimizer=args.optimizer) for c in range(CLUSTERS)]
    theta = worlds[0].read()  # theta_global, the same on every cluster
    outer = OuterOptimizer(lr, momentum, nesterov=True)
    codec = (TopKCodec(args.density, args.bits, span=args.span) if args.span
             else get_codec(args.codec, density=args.density, bits=args.bits))
    # the relay's error feedback, one residual each; decay None: the codec's own
    feedback = [ErrorFeedback(codec, decay) for _ in worlds]
    sent_bytes = 0
    anchor: list[torch.Tensor] = [theta] * CLUSTERS
    pending: torch.Tensor | None = None
    due: int | None = None

    def average(deltas: list[torch.Tensor]) -> torch.Tensor:
        nonlocal sent_bytes
        encs = [fb.encode(d, key="delta") for fb, d in zip(feedback, deltas, strict=True)]
        sent_bytes += sum(e.nbytes for e in encs)
        return torch.stack([codec.decode(e) for e in encs]).mean(0)

    def merge() -> None:
        nonlocal pending, due
        assert pending is not None
        outer.step(theta, pending)
        for c, w in enumerate(worlds):
            w.write(theta - (anchor[c] - w.read()))
        pending = due = None

    for step in range(1, args.steps + 1):
        for w in worlds:
            w.step()
        if due == step:
            merge()
        if step % args.inner_steps:
            continue
        if pending is not None:  # still in flight at the boundary (late, or tau >= H)
            merge()
        deltas = [theta - w.read() for w in worlds]
        if mode == "sync":
            outer.step(theta, average(deltas))
            for w in worlds:
                w.write(theta)
            continue
        anchor = [w.read() for w in worlds]
        pending = average(deltas)
        due = step + args.tau if mode == "overlap" else None
    if pending is not None:  # the flush at the end of training
        merge()
    if args.flush and args.codec == TopKParams.name and mode == "sync":
        # the relays' last round: what error feedback still holds, sent with int8
        flush_codec = get_codec("int8")
        encs = [fb.encode(theta - w.read(), key="delta", codec=flush_codec)
                for fb, w in zip(feedback, worlds, strict=True)]
        sent_bytes += sum(e.nbytes for e in encs)
        flush_outer = OuterOptimizer(args.flush_lr, 0.0, nesterov=True)
        flush_outer.step(theta, torch.stack([flush_codec.decode(e) for e in encs]).mean(0))
        for w in worlds:
            w.write(theta)
    finals = [w.read() for w in worlds]
    losses = [evaluate(w.model, held) for w in worlds]
    # flat data parallel sends every step's fp32 gradient (one model's worth per cluster); DiLoCo
    # sends each cluster's encoded delta once a round: bytes per token, one cluster's view
    flat_bytes = 4 * theta.numel() * args.steps * CLUSTERS
    return {"eval": sum(losses) / len(losses),
            "identical": all(torch.equal(finals[0], f) for f in finals[1:]),
            "bytes_reduction": flat_bytes / max(1, sent_bytes)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--inner-steps", type=int, default=None,
                   help="DiLoCo H (default: the codec's, 25; topk: 10)")
    p.add_argument("--seeds", default="1234",
                   help="comma-separated seeds; the gap printed last is the median over them")
    p.add_argument("--settings", nargs="+", default=None,
                   help="outer lr,momentum pairs (Nesterov; default: the codec's, 0.6,0.5; "
                        "topk: 2.5,0)")
    p.add_argument("--modes", nargs="+", default=["sync", "overlap"],
                   choices=["sync", "overlap", "late"])
    p.add_argument("--tau", type=int, default=3, help="overlap: steps until the average lands")
    p.add_argument("--codec", default=DEFAULT_CODEC, choices=KNOWN_CODECS,
                   help="the relay's WAN codec (with error feedback)")
    p.add_argument("--density", type=float, default=TopKParams.density,
                   help="topk: kept fraction")
    p.add_argument("--bits", type=int, default=TopKParams.bits,
                   help="topk: bits per kept value")
    p.add_argument("--span", type=int, choices=TOPK_SPANS, default=None,
                   help="topk: elements per top-k span, a power of two from 16 to 4096 "
                        "(default: from the density, 16 or 256)")
    p.add_argument("--decays", default=None,
                   help="comma-separated error-feedback decays beta to compare "
                        "(compression.feedback_decay; default: the codec's)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=ADAMW,
                   help="the inner optimizer of every world, flat's too: AdamW, or Muon on the "
                        "blocks' matrices with AdamW on the rest (examples/gpt/optim.py)")
    p.add_argument("--workers-per-cluster", type=int, default=2,
                   help="2 as in bench/wan_training.py, 1 as in bench/hetero.py")
    p.add_argument("--micro-batch", type=int, default=4,
                   help="per-worker 128-token sequences: 4 as in bench/wan_training.py, 16 as "
                        "in bench/hetero.py (examples/gpt's ds_config.json)")
    p.add_argument("--flush", action="store_true",
                   help="sync mode: a last round sends what error feedback still holds (int8)")
    p.add_argument("--flush-lr", type=float, default=1.0, help="--flush: that round's outer lr")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    if args.workers_per_cluster < 1 or args.micro_batch < 1:
        p.error("--workers-per-cluster and --micro-batch must be at least 1")
    h, lr, momentum = schedule(args.codec)
    args.inner_steps = args.inner_steps or h
    args.settings = args.settings or [f"{lr:g},{momentum:g}"]
    try:
        args.pairs = [tuple(float(x) for x in s.split(",")) for s in args.settings]
        args.seed_list = [int(x) for x in args.seeds.split(",")]
        args.decay_list = ([float(x) for x in args.decays.split(",")] if args.decays
                           else [CompressionSpec(codec=args.codec).decay_for(args.codec)])
    except ValueError:
        p.error("--settings takes lr,momentum pairs such as 0.7,0.9; --seeds integers; "
                "--decays numbers")
    if any(not 0.0 < d <= 1.0 for d in args.decay_list):
        p.error("--decays: each in (0, 1]")
    if args.span is not None and args.codec != TopKParams.name:
        p.error(f"--span is topk's (--codec {TopKParams.name}), not {args.codec}'s")
    if any(len(pair) != 2 for pair in args.pairs):
        p.error("--settings takes lr,momentum pairs such as 0.7,0.9")
    return args


def combos(args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    """(mode, outer lr, outer momentum, feedback decay) of each DiLoCo run of a seed."""
    return [(mode, lr, momentum, decay) for mode in args.modes for lr, momentum in args.pairs
            for decay in args.decay_list]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    split = split_corpus(load_corpus())
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []
    flats = {}
    for seed in args.seed_list:
        held = eval_batches(split.eval, EVAL_BATCHES, EVAL_MICRO, CONTEXT, seed=seed)
        flat = flats[seed] = run_flat(args, seed, split, held)
        for mode, lr, momentum, decay in combos(args):
            out = run_diloco(args, seed, split, held, lr, momentum, mode, decay)
            runs.append({"seed": seed, "mode": mode, "outer_lr": lr,
                         "outer_momentum": momentum, "feedback_decay": decay,
                         "eval": round(out["eval"], 4),
                         "flat_eval": round(flat, 4), "identical": out["identical"],
                         "gap": round((out["eval"] - flat) / flat, 4),
                         "bytes_per_token_reduction": round(out["bytes_reduction"], 1)})
            print(f"seed {seed} {mode:8s} lr {lr:<4g} momentum {momentum:<4g} decay "
                  f"{decay:<4g} eval "
                  f"{out['eval']:.4f} (flat {flat:.4f}) gap {100 * runs[-1]['gap']:+.2f} %",
                  file=sys.stderr, flush=True)
    codec = args.codec + (f" density {args.density} bits {args.bits} span {args.span or 'auto'}"
                          if args.codec == TopKParams.name else "")
    print(f"{args.steps} steps, {args.workers_per_cluster} worker(s) per cluster of "
          f"{args.micro_batch} x {CONTEXT} tokens, inner optimizer {args.optimizer}, "
          f"H={args.inner_steps}, codec {codec}, seeds {args.seeds}, "
          f"tau {args.tau}, {time.monotonic() - t0:.0f} s")
    print(f"{'seed':>5s}  {'mode':8s}  {'outer lr':>8s}  {'momentum':>8s}  {'decay':>5s}  "
          f"{'eval loss':>9s}  {'flat':>7s}  {'gap':>7s}  {'bytes/token':>11s}")
    for r in runs:
        print(f"{r['seed']:5d}  {r['mode']:8s}  {r['outer_lr']:8g}  {r['outer_momentum']:8g}  "
              f"{r['feedback_decay']:5g}  {r['eval']:9.4f}  {r['flat_eval']:7.4f}  "
              f"{100 * r['gap']:+6.2f}%  "
              f"{r['bytes_per_token_reduction']:10.1f}x")
    medians = []
    for mode, lr, momentum, decay in combos(args):
        mine = [r for r in runs if (r["mode"], r["outer_lr"], r["outer_momentum"],
                                    r["feedback_decay"]) == (mode, lr, momentum, decay)]
        medians.append({"mode": mode, "outer_lr": lr, "outer_momentum": momentum,
                        "feedback_decay": decay,
                        "loss_gap": statistics.median(r["gap"] for r in mine),
                        "bytes_per_token_reduction": statistics.median(
                            r["bytes_per_token_reduction"] for r in mine)})
        print(f"median over seeds {args.seeds}: {mode} lr {lr:g} momentum {momentum:g} "
              f"decay {decay:g}: loss gap {100 * medians[-1]['loss_gap']:+.2f} %, bytes per token "
              f"{medians[-1]['bytes_per_token_reduction']:.1f}x fewer than flat")
    if args.json:
        first = medians[0]
        print(json.dumps({"loss_gap": first["loss_gap"],
                          "bytes_per_token_reduction": first["bytes_per_token_reduction"],
                          "medians": medians, "runs": runs,
                          "settings": {"steps": args.steps, "inner_steps": args.inner_steps,
                                       "seeds": args.seed_list, "tau": args.tau,
                                       "codec": args.codec, "density": args.density,
                                       "bits": args.bits, "span": args.span,
                                       "decays": args.decay_list,
                                       "optimizer": args.optimizer}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
