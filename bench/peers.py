"""nebula beside the systems built for the same job: torchft's DiLoCo and hivemind, on one test bed.

    .venv/bin/python bench/peers.py [--quick] [--json] [--seeds 1234,1,2] [--steps N]
                                    [--mbit 20] [--delay-ms 25] [--micro-batch 4]
                                    [--systems flat,torchft,hivemind,nebula-int8,...]

Needs root (the test bed: tests/testbed, bench/_bed.py). One bed: two clusters (east = e1, e2;
west = w1, w2), one CPU worker per host, the east-west link shaped by the router's tc htb to
--mbit each way. Every system trains the quickstart GPT of examples/gpt (1.3 M parameters, the
same seed so the same initial weights), each worker drawing the batch stream of its (cluster,
rank) from examples/gpt/data.py (the same order in every system; flat's one cluster numbers its
four ranks 0-3), micro batch --micro-batch x 128 tokens, the same number of steps, hence of
tokens; inner optimizer examples/gpt/ds_config.json's (AdamW lr 0.002, warmup 30 steps,
clipping 1.0):

  flat          nebula's flat job: one DeepSpeed world of all four hosts, gloo all-reduce of the
                gradients over the link every step (bench/wan_training.py's (a)).
  torchft       torchft 0.2.0 `DiLoCo` + `Manager` + lighthouse (bench/_peers_torchft.py says
                which of its examples and settings): a replica group per cluster (torch DDP
                inside), outer SGD Nesterov every H steps, fp32 all-reduce of the
                pseudo-gradients between the groups' same ranks (gloo).
  hivemind      hivemind 1.1.12 `hivemind.Optimizer(use_local_updates=True)` (bench/
                _peers_hivemind.py says which docs and settings): every worker a peer, parameters
                averaged (fp16) every H steps' worth of all workers' samples.
  nebula-int8   nebula's relay DiLoCo, int8 + error feedback, H and outer lr/momentum of
                bench/_schedules.py for int8 (the same H and outer settings as torchft's row).
  nebula-topk   the same with topk (its own schedule: H=10, outer lr 2.5, momentum 0).
  nebula-auto   the same with `compression: auto` (H as topk's, each codec's own outer settings).

The peers run in their own venvs (bench/_peers_venvs.py: ~/.cache/nebula-bench/venvs/<peer>,
torch 2.13.0 CPU, then the peer from PyPI); a peer that cannot be installed or fails to run
gets a row with `error` saying exactly what failed; nothing stands in for it.

The delay, the same for everyone: netem does not exist in this kernel, so every TCP connection
between the clusters, of every system (gloo's mesh, torchft's lighthouse, managers, stores and
all-reduces, hivemind's libp2p, nebula's relays), goes through one
transparent delaying proxy in the router (bench/_peers_delay.py: nftables DNAT +
SO_ORIGINAL_DST, tests/testbed/delay_proxy.Stream's delay line) that adds --delay-ms one way
in each direction (a round trip of 2 x --delay-ms on top of the bed's ~0.1 ms). nebula's relay
shaping is off (delay 0), so it gets no other delay than the peers. Bytes are counted on the
link the same way for everyone: the router's htb class counters (`_bed.link_bytes`, IP packets
between the clusters, the proxy changing nothing in what crosses).

Columns (bench/_peers_figures.py has the exact definitions): wall time to the target eval loss
(flat's final eval loss + 3 %, from the end of step 1), final eval loss at equal tokens,
tokens/s, WAN bytes per token, identical parameters on every worker at the end. The last line
(--json) is one JSON object: time_to_target_vs_best_peer, bytes_vs_best_peer,
loss_at_equal_tokens_vs_best_peer (nebula's best row over the best peer's; the median over the
seeds), rows, seeds, goals_met (time <= 1/1.5, bytes <= 1/10, loss <= 1), then targets,
per_seed and settings. Compute: the four workers share this machine's cores with the proxy,
the relays and (on a shared machine) other work, so time columns are noisy; 'load' is printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bed  # noqa: E402
import _peers_delay  # noqa: E402
import _peers_figures as figures  # noqa: E402
import _peers_jobs as jobs  # noqa: E402
import _peers_venvs  # noqa: E402
from _schedules import schedule  # noqa: E402

JSON_FIELDS = figures.JSON_FIELDS
CLUSTERS = {"east": ["e1", "e2"], "west": ["w1", "w2"]}
SYSTEMS = (figures.FLAT, *figures.PEERS, *figures.NEBULA)
QUICK = {"steps": 40, "dense_h": 20}
FULL = {"steps": 200}
FLAT_EVAL_EVERY = 10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--mbit", type=float, default=20.0, help="east-west link rate (Mbit/s)")
    p.add_argument("--delay-ms", type=float, default=25.0,
                   help="one-way delay the router's proxy adds to every connection between "
                        "the clusters (round trip 2x)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"steps of every job (default {FULL['steps']}; --quick "
                        f"{QUICK['steps']})")
    p.add_argument("--micro-batch", type=int, default=4, help="per-worker micro batch (x 128)")
    p.add_argument("--seeds", default="1234,1,2", help="comma-separated seeds (--quick: the "
                                                       "first only)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="which rows to run (flat is needed for the target)")
    p.add_argument("--quick", action="store_true",
                   help=f"one seed, {QUICK['steps']} steps, H={QUICK['dense_h']} for int8 and "
                        "the peers (27 minutes measured on 2 cores shared with other work, "
                        "load 12, the venvs already made)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, records)")
    args = p.parse_args(argv)
    try:
        args.seed_list = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        p.error("--seeds takes integers such as 1234,1,2")
    if args.quick:
        args.seed_list = args.seed_list[:1]
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.system_list) - set(SYSTEMS))
    if unknown or figures.FLAT not in args.system_list:
        p.error(f"--systems: one or more of {', '.join(SYSTEMS)}, flat included "
                f"(unknown: {', '.join(unknown) or '-'})")
    args.steps = args.steps or (QUICK["steps"] if args.quick else FULL["steps"])
    dense_h, lr, momentum = schedule("int8")
    args.dense_h = QUICK["dense_h"] if args.quick else dense_h
    args.outer_lr, args.outer_momentum = lr, momentum
    args.topk_h = schedule("topk")[0]
    if args.steps < 2 or args.steps % args.dense_h or args.steps % args.topk_h:
        p.error(f"--steps must be a multiple of H={args.dense_h} and of topk's "
                f"H={args.topk_h} (every job ends on a sync boundary)")
    if args.mbit <= 0 or args.delay_ms < 0 or args.micro_batch < 1:
        p.error("--mbit > 0, --delay-ms >= 0, --micro-batch >= 1")
    return args


def nebula_relay(args: argparse.Namespace, codec: str) -> dict[str, Any]:
    """The relay section of a nebula row (shaping off: the router's proxy delays everyone)."""
    if codec == "int8":
        sync = {"mode": "diloco", "inner_steps": args.dense_h, "outer_lr": args.outer_lr,
                "outer_momentum": args.outer_momentum}
    elif codec == "topk":
        h, lr, momentum = schedule("topk")
        sync = {"mode": "diloco", "inner_steps": h, "outer_lr": lr, "outer_momentum": momentum}
    else:  # auto: each round's codec brings its own outer settings (the spec's defaults)
        sync = {"mode": "diloco", "inner_steps": args.topk_h}
    return {"sync": sync, "compression": {"codec": codec, "error_feedback": True},
            "timeout": 300, "shaping": {"rate_mbit": None, "delay_ms": 0.0}}


def eval_every(args: argparse.Namespace, system: str) -> int:
    return {"nebula-topk": args.topk_h, "nebula-auto": args.topk_h,
            figures.FLAT: FLAT_EVAL_EVERY}.get(system, args.dense_h)


def run_system(system: str, neb: _bed.Nebula, bed: Any, tmp: Path, args: argparse.Namespace,
               seed: int) -> jobs.Job:
    """One system's job on the bed (RuntimeError / VenvError with what failed)."""
    common = {"steps": args.steps, "micro_batch": args.micro_batch, "seed": seed}
    if system == figures.FLAT:
        flat = {"flat": [h for hs in CLUSTERS.values() for h in hs]}
        job = jobs.run_nebula(neb, bed, tmp, name=f"flat-{seed}", clusters=flat, relay=None,
                              eval_every=FLAT_EVAL_EVERY, **common)
        job.name = system  # the row's name (the job's files are named by seed)
        return job
    if system in figures.NEBULA:
        codec = system.removeprefix("nebula-")
        job = jobs.run_nebula(neb, bed, tmp, name=f"{system}-{seed}", clusters=CLUSTERS,
                              relay=nebula_relay(args, codec),
                              eval_every=eval_every(args, system), **common)
        job.name = system
        return job
    python = _peers_venvs.ensure(system, say=_bed.say)
    if system == "torchft":
        return jobs.run_torchft(bed, tmp / f"s{seed}", python, clusters=CLUSTERS,
                                sync_every=args.dense_h, outer_lr=args.outer_lr,
                                outer_momentum=args.outer_momentum, **common)
    return jobs.run_hivemind(bed, tmp / f"s{seed}", python, clusters=CLUSTERS,
                             sync_every=args.dense_h, **common)


def run_seed(neb: _bed.Nebula, bed: Any, tmp: Path, args: argparse.Namespace,
             seed: int) -> list[figures.Row]:
    """Every system once on this seed, flat first (its final loss sets the target)."""
    (tmp / f"s{seed}").mkdir(exist_ok=True)
    done: list[tuple[str, jobs.Job | None, str | None]] = []
    for system in args.system_list:
        _bed.say(f"seed {seed}: {system} ({args.steps} steps) ...")
        try:
            job: jobs.Job | None = run_system(system, neb, bed, tmp, args, seed)
            err = None
        except (RuntimeError, _peers_venvs.VenvError, OSError) as exc:
            job, err = None, f"{type(exc).__name__}: {exc}"
            _bed.say(f"seed {seed}: {system} FAILED: {err.splitlines()[0]}")
        done.append((system, job, err))
    flat_job = next((j for s, j, _ in done if s == figures.FLAT and j is not None), None)
    flat_row = figures.row(flat_job, seed, None) if flat_job else None
    target = figures.target_of(flat_row) if flat_row else None
    rows = []
    for system, job, err in done:
        r = (figures.Row(system, seed, error=err) if job is None
             else figures.row(job, seed, target))
        rows.append(r)
        if r.error is None:
            _bed.say(f"seed {seed}: {system}: eval {r.eval_loss}, {r.tokens_per_s} tokens/s, "
                     f"{r.wan_bytes_per_token} B/token, target at {r.time_to_target_s} s")
    return rows


def report(rows: list[figures.Row], summary: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [_bed.table(["system", "seed", "s to target", "eval loss", "tokens/s",
                         "WAN B/token", "same params", "wall s", "error"], figures.table(rows)),
             ""]
    ratios = []
    for key, goal in figures.GOALS.items():
        met = summary["goals_met"][key]
        ratios.append([key, summary[key], f"<= {goal:.3g}", "met" if met else "NOT met"])
    lines.append(_bed.table(["ratio (nebula's best / best peer)", "value", "goal", ""], ratios))
    lines.append("")
    lines.append(
        f"targets (flat's final eval loss + 3 %): {summary['targets']}. Link {args.mbit:g} "
        f"Mbit/s each way (tc htb), {args.delay_ms:g} ms one way on every connection between "
        f"the clusters (the router's delaying proxy, every system). {args.steps} steps x 4 "
        f"workers x {args.micro_batch} x 128 tokens; H={args.dense_h} (int8, torchft, "
        f"hivemind's target batch), H={args.topk_h} (topk, auto); outer lr "
        f"{args.outer_lr:g} / momentum {args.outer_momentum:g} (int8, torchft). "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end.")
    return "\n".join(lines)


def stop_on_signals() -> None:
    """SIGTERM (and SIGINT, which a shell's background job ignores) end the run through its
    `finally` blocks: every job stopped, the proxy and the bed removed."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, interrupt)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _bed.require_bed()
    stop_on_signals()
    tmp = Path(tempfile.mkdtemp(prefix="nebula-bench-peers-"))
    rows: list[figures.Row] = []
    started = time.strftime("%Y-%m-%d %H:%M")
    try:
        with _bed.make_bed(CLUSTERS, args.mbit) as bed:
            delay = _peers_delay.install(bed, args.delay_ms)
            neb = _bed.Nebula(bed, tmp / "home")
            try:
                for seed in args.seed_list:
                    rows += run_seed(neb, bed, tmp, args, seed)
            finally:
                neb.cleanup()
                _peers_delay.remove(bed, delay)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    settings = {"steps": args.steps, "micro_batch": args.micro_batch, "mbit": args.mbit,
                "delay_ms": args.delay_ms, "dense_h": args.dense_h, "topk_h": args.topk_h,
                "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
                "quick": args.quick, "systems": args.system_list, "started": started,
                "load_average": round(os.getloadavg()[0], 2)}
    summary = figures.summarize(rows, args.seed_list, settings)
    print(report(rows, summary, args))
    if args.json:
        _bed.emit_json(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
