"""Memory per round at a resolution the hour soak cannot give: bench/soak.py's job without
faults, its rounds as fast as this machine turns them, for thousands of rounds.

    .venv/bin/python bench/round_memory.py [--quick] [--json] [--rounds 30000]
        [--model tiny|quickstart] [--sample-every 10] [--out DIR]

The hour soak's per-process fits (~3,500 rounds, a round every ~0.8 s) carry 1-1.6 MiB of
standard error per 1,000 rounds: they cannot tell the goal's 1 MiB from 3. Here the same job
(two clusters of one local host each; their agents, log pumps and relays as the soak runs them;
int8 with error feedback; checkpoints, rotated logs and records) trains a tiny GPT (d_model 32,
one layer, context 32: a step of a few milliseconds) with a round every step and the relays'
link unshaped. A round then costs what nebula's own work in it costs (the worker's hook and
relay client, the relays' agreement, exchange and average, the records and logs written), so
that many more rounds fit in the same time and a fit's error per 1,000 rounds is smaller. What
stays out: the model's own size. ``--model quickstart`` trains the quickstart's GPT (the hour
soak's) instead, for growth that scales with the model: ~3 rounds a second here, so fewer
rounds, sampled more often (``--sample-every 3``: the fit's error falls with the square root
of the samples); the job's state is read every STATUS_EVERY seconds, not at every sample.

Every --sample-every seconds (10): RSS and descriptors of every process of the job by kind
(bench/_soak_sample.py). Printed per process: its growth per 1,000 rounds after its warm-up
(its first --warmup of samples) with the fit's standard error, the same fit over the last half
of its life, and per kind the largest growth (the goal: at most 1 MiB per 1,000 rounds). Plots
and samples go to --out. The last line is a JSON object (JSON_FIELDS). --quick: 3,000 rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak  # noqa: E402
from _local import Cli  # noqa: E402
from _soak_sample import KINDS, Sample, fit, lives, processes, settled  # noqa: E402

JSON_FIELDS = ("rounds", "rss_growth_mb_per_1000_rounds", "rss_growth_stderr",
               "fd_growth_per_1000_rounds", "rounds_per_s", "left_processes", "goals_met")
GOAL_MB = 1.0
MODELS = {"tiny": "--d-model 32 --n-layer 1 --n-head 2 --context 32", "quickstart": ""}
"""train.py's model options per --model (the quickstart's GPT: train.py's defaults)."""
STATUS_EVERY = 30.0
"""Seconds between two reads of the job's state (one takes about a second of a core)."""
CHECKPOINT_EVERY = 500
"""Steps between checkpoints (the soak's 10 would write one every few seconds here)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3,000 rounds (a few minutes)")
    p.add_argument("--json", action="store_true", help="print a JSON object last (always)")
    p.add_argument("--rounds", type=int, help="rounds of the job (default 30,000)")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny",
                   help="the GPT trained: tiny (a step of milliseconds) or the quickstart's")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=0.2,
                   help="fraction of each process's samples left out of its fit")
    p.add_argument("--out", type=Path, default=None, help=soak.OUT_HELP)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3000 if args.quick else 30_000)
    return args


def per_process(samples: list[Sample], warmup: float) -> list[dict[str, Any]]:
    """Each process that lived through enough rounds: its fits after warm-up and over its last
    half, MiB and descriptors per 1,000 rounds."""
    out = []
    for kind in KINDS:
        for pid, points in lives(samples, kind).items():
            rest = settled(points, warmup)
            if len(rest) < 6 or rest[-1][0] - rest[0][0] < 100:
                continue
            half = points[len(points) // 2:]
            xs = [r / 1000 for r, _, _ in rest]
            whole, late = fit(xs, [m for _, m, _ in rest]), fit(
                [r / 1000 for r, _, _ in half], [m for _, m, _ in half])
            out.append({"kind": kind, "pid": pid, "samples": len(points),
                        "rounds": [rest[0][0], rest[-1][0]],
                        "rss_mb": [round(rest[0][1], 1), round(rest[-1][1], 1)],
                        "rss_growth": round(whole.slope, 3), "stderr": round(whole.stderr, 3),
                        "rss_growth_last_half": round(late.slope, 3),
                        "stderr_last_half": round(late.stderr, 3),
                        "fd_growth": round(fit(xs, [float(f) for _, _, f in rest]).slope, 3)})
    return out


def training(samples: list[Sample]) -> list[Sample]:
    """The samples taken while workers ran: the launch before them and the job's end after
    them (the final agreement's wait, the exits: the relays shrink over no new round) are no
    round's memory."""
    return [s for s in samples if s.count.get("worker")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, soak.terminate)
    label = f"rounds-{args.rounds}" + ("" if args.model == "tiny" else f"-{args.model}")
    model_args = MODELS[args.model]
    run_args = argparse.Namespace(inner_steps=1, sample_every=args.sample_every, every=0.0,
                                  minutes=0.0, seed=0)
    with tempfile.TemporaryDirectory(prefix="nebula-round-memory-") as tmp, \
            contextlib.ExitStack() as stack:
        cli = Cli(Path(tmp) / "home")
        stack.callback(soak.stop_every_job, cli)
        print(f"{args.rounds} rounds: a round every step of the {args.model} GPT "
              f"({model_args or 'train.py defaults'}), the relays' link unshaped, a sample "
              f"every {args.sample_every:g} s", flush=True)
        spec = soak.write_spec(Path(tmp), "rounds", args.rounds, run_args,
                               model_args=model_args, checkpoint_every=CHECKPOINT_EVERY,
                               wan=False)
        outcome = soak.run(cli, spec, run_args, (), status_every=STATUS_EVERY)
        time.sleep(3)
        left = sum(len(v) for v in processes(outcome.job_id).values())
    samples = outcome.samples
    args.out = soak.out_folder(args.out)
    (args.out / f"soak-{label}-samples.json").write_text(json.dumps([asdict(s) for s in samples]))
    plots = soak.plot(samples, args.out, label)
    print(f"samples and plots in {args.out}", flush=True)
    procs = per_process(training(samples), args.warmup)
    rounds = samples[-1].rounds if samples else 0
    worst = {k: max((p for p in procs if p["kind"] == k), key=lambda p: p["rss_growth"],
                    default=None) for k in KINDS}
    growth = {k: (p["rss_growth"] if p else None) for k, p in worst.items()}
    stderr = {k: (p["stderr"] if p else None) for k, p in worst.items()}
    fds = {k: max((p["fd_growth"] for p in procs if p["kind"] == k), default=None) for k in KINDS}
    print(f"\n{rounds} rounds in {outcome.seconds:.0f} s ({rounds / outcome.seconds:.1f} a second)"
          f", {len(samples)} samples")
    print(f"{'kind':8s} {'pid':>7s} {'rounds':>13s} {'MiB':>13s} {'MiB/1000 rounds':>18s} "
          f"{'last half':>16s} {'fds/1000':>9s}")
    for p in procs:
        print(f"{p['kind']:8s} {p['pid']:7d} {p['rounds'][0]:6d}-{p['rounds'][1]:<6d} "
              f"{p['rss_mb'][0]:6.1f}-{p['rss_mb'][1]:<6.1f} "
              f"{p['rss_growth']:+8.3f} ± {p['stderr']:.3f}  "
              f"{p['rss_growth_last_half']:+7.3f} ± {p['stderr_last_half']:.3f} "
              f"{p['fd_growth']:+9.3f}")
    measured = [v for v in growth.values() if v is not None]
    goals = bool(measured) and all(v <= GOAL_MB for v in measured) and left == 0
    print("largest per kind: " + ", ".join(
        f"{k} {growth[k]:+.3f} ± {stderr[k]:.3f}" for k in KINDS if growth[k] is not None)
        + f" MiB per 1,000 rounds (goal <= {GOAL_MB:g}); processes left {left}")
    print(f"plots: {', '.join(plots) or 'none (no matplotlib)'}")
    summary = {"rounds": rounds, "rss_growth_mb_per_1000_rounds": growth,
               "rss_growth_stderr": stderr, "fd_growth_per_1000_rounds": fds,
               "rounds_per_s": round(rounds / outcome.seconds, 2), "left_processes": left,
               "goals_met": goals, "processes": procs, "seconds": round(outcome.seconds, 1),
               "settings": {"rounds": args.rounds, "model": args.model,
                            "model_args": model_args, "inner_steps": 1,
                            "sample_every_s": args.sample_every, "warmup": args.warmup,
                            "checkpoint_every": CHECKPOINT_EVERY, "quick": args.quick},
               "final_state": outcome.status.get("state")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
