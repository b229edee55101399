"""Clusters of unequal speed: a fixed H against time-based rounds (``sync.every``), in one run on
this machine (local transport, no root needed).

    .venv/bin/python bench/hetero.py [--quick] [--json] [--slowdown 2] [--steps 200] [--seed S]

Two clusters (east, west: one host, one CPU worker each, each worker pinned to its own core with
one thread, so that a slowed cluster does not lend its core to the other) train the small GPT of
examples/gpt through the relays, which emulate a WAN (20 Mbit/s, 25 ms each way). West is made
``--slowdown`` times slower honestly: after each step its worker waits (slowdown - 1) times that
step's own compute time (`train.py --slowdown`), as an older GPU would take longer.
Codec, H and outer settings are the codec's benchmark schedule (bench/_schedules.py); --inner-steps
sets H, --outer-lr and --outer-momentum the outer settings.

  (a) both fast, a round every H steps, --steps each: the fast cluster's tokens/s alone
  (b) west slower, a round every H steps, --steps each: east waits for west at every round
  (c) west slower, time-based rounds every H x (a)'s seconds per step, east --steps and west
      --steps / slowdown (about the same wall time): nobody waits, the average is weighted by
      the samples each cluster trained on
  (d) flat DeepSpeed, one world of 2 workers, as many tokens as (b), no WAN (its loss only)
  (e) the same with as many tokens as (c)

fast_cluster_utilization = east's tokens/s in (c) / in (a) (its seconds per step over its whole
loop, rounds and evaluations included); fast_cluster_utilization_fixed_h the same for (b);
loss_gap: (c)'s final eval loss against (e)'s, relative; loss_gap_fixed_h: (b) against (d);
slowdown: west's seconds per step over east's in (c). Goal (issue 14): with one cluster 2x
slower, fast_cluster_utilization >= 0.95 and loss_gap <= 3 % (fixed H gives about 0.5).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bed import ratio, table  # noqa: E402
from _local import GPT_DIR, REPO, Cli, records  # noqa: E402
from _schedules import schedule  # noqa: E402

sys.path.insert(0, str(REPO))
from nebula_cli.config.sections import CompressionSpec  # noqa: E402

JSON_FIELDS = ("fast_cluster_utilization", "fast_cluster_utilization_fixed_h", "loss_gap",
               "loss_gap_fixed_h", "slowdown")
"""Keys of the JSON object printed last with --json, first (then settings, goals_met, runs)."""
GOALS = {"fast_cluster_utilization": 0.95, "loss_gap": 0.03}
QUICK = {"steps": 60}
LINK = {"rate_mbit": 20.0, "delay_ms": 25.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--quick", action="store_true", help=f"{QUICK['steps']} steps (a smoke run)")
    p.add_argument("--steps", type=int, default=None, help="the fast cluster's steps (200)")
    p.add_argument("--slowdown", type=float, default=2.0, help="how much slower west is")
    p.add_argument("--codec", default=CompressionSpec.model_fields["codec"].default)
    p.add_argument("--inner-steps", type=int, default=None,
                   help="H, and the time-based rounds' interval in (a)'s steps (default: the "
                        "codec's schedule, bench/_schedules.py)")
    p.add_argument("--outer-lr", type=float, default=None,
                   help="the outer learning rate (default: the codec's schedule)")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="the outer Nesterov momentum (default: the codec's schedule)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    h, lr, momentum = schedule(args.codec)
    args.inner_steps = args.inner_steps or h
    args.outer_lr = lr if args.outer_lr is None else args.outer_lr
    args.outer_momentum = momentum if args.outer_momentum is None else args.outer_momentum
    if args.inner_steps < 1:
        p.error("--inner-steps must be at least 1")
    args.steps = args.steps or (QUICK["steps"] if args.quick else 200)
    if args.slowdown < 1:
        p.error("--slowdown must be at least 1")
    return args


def spec_of(tmp: Path, name: str, args: argparse.Namespace, *, sync: dict[str, Any] | None,
            steps: dict[str, int], slow: bool) -> Path:
    """A job of two one-worker clusters (``sync``: relay.sync; None: flat DeepSpeed, one
    cluster with a host of two slots)."""
    h, lr, momentum = args.inner_steps, args.outer_lr, args.outer_momentum
    run = (f"python -u train.py --eval-every 1000000 --log-every 10 --seed {args.seed}")
    spec: dict[str, Any] = {"name": name, "workdir": str(GPT_DIR), "run": run,
                            "deepspeed": "ds_config.json", "env": {"OMP_NUM_THREADS": "1"}}
    if sync is None:
        spec["clusters"] = [{"name": "flat", "transport": "local",
                             "hosts": [{"host": "f1", "slots": 2}],
                             "env": {"NEBULA_STEPS": str(steps["flat"])}}]
    else:
        spec["clusters"] = [
            {"name": c, "transport": "local", "hosts": [{"host": f"{c[0]}1"}],
             "env": {"NEBULA_STEPS": str(steps[c]), "GPT_CPUS": str(i % (os.cpu_count() or 1)),
                     **({"GPT_SLOWDOWN": f"{args.slowdown:g}"} if slow and c == "west" else {})}}
            for i, c in enumerate(("east", "west"))]
        spec["relay"] = {"sync": {"outer_lr": lr, "outer_momentum": momentum,
                                  **({"inner_steps": h} if "every" not in sync else {}), **sync},
                         "compression": {"codec": args.codec}, "shaping": dict(LINK),
                         "timeout": 600}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_job(cli: Cli, spec: Path) -> dict[str, Any]:
    """Launch, wait for the end; per cluster its final record, and the relays' rounds."""
    t0 = time.monotonic()
    job_id = cli("launch", str(spec), "--detach", timeout=600).stdout.strip().splitlines()[-1]
    try:
        while (st := cli.status(job_id)).get("state") in ("PENDING", "RUNNING", None):
            time.sleep(1.0)
    finally:
        cli("stop", job_id, "--force")
    if st.get("state") != "SUCCEEDED":
        raise SystemExit(f"{spec.stem}: job {job_id} ended {st.get('state')}: {st.get('reason')}")
    finals = {r["cluster"]: r for r in records(cli.home, job_id) if r.get("final")}
    rounds = [r for r in records(cli.home, job_id, "relay") if r.get("cluster") == "east"]
    out = {"job": spec.stem, "seconds": round(time.monotonic() - t0, 1),
           "identical": len({r["param_sha256"] for r in finals.values()}) == 1,
           "eval_loss": next(iter(finals.values()))["eval_loss"],
           "s_per_step": {c: round(r["s_per_step"], 4) for c, r in finals.items()},
           "steps": {c: r["step"] for c, r in finals.items()},
           "joint_rounds": sum(len(r.get("present", [])) == 2 for r in rounds)}
    weights = [r["weights"] for r in rounds if r.get("weights") and len(r["present"]) == 2]
    if weights:
        out["weight_east_share"] = round(sum(w["east"] for w in weights) / sum(
            w["east"] + w["west"] for w in weights), 3)
    print(f"  {spec.stem}: {out['seconds']:.0f}s, s/step {out['s_per_step']}, steps "
          f"{out['steps']}, eval {out['eval_loss']:.4f}, identical {out['identical']}",
          flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n, s = args.steps, args.slowdown
    h = args.inner_steps
    started = datetime.datetime.now().isoformat(timespec="seconds")
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="nebula-hetero-") as tmp:
        cli = Cli(Path(tmp) / "home")
        base = Path(tmp)
        print(f"hetero: codec {args.codec}, H {h}, outer lr {args.outer_lr:g} momentum "
              f"{args.outer_momentum:g}, west {s:g}x slower, {n} steps, seed {args.seed}",
              flush=True)
        runs["a"] = run_job(cli, spec_of(base, "a-both-fast", args, sync={},
                                         steps={"east": n, "west": n}, slow=False))
        every = round(h * runs["a"]["s_per_step"]["east"], 3)
        runs["b"] = run_job(cli, spec_of(base, "b-fixed-h", args, sync={},
                                         steps={"east": n, "west": n}, slow=True))
        slow_steps = max(h, round(n / s))
        runs["c"] = run_job(cli, spec_of(base, "c-time-based", args, sync={"every": every},
                                         steps={"east": n, "west": slow_steps}, slow=True))
        runs["d"] = run_job(cli, spec_of(base, "d-flat-as-b", args, sync=None,
                                         steps={"flat": n}, slow=False))
        runs["e"] = run_job(cli, spec_of(base, "e-flat-as-c", args, sync=None,
                                         steps={"flat": round((n + slow_steps) / 2)},
                                         slow=False))
    east = {k: runs[k]["s_per_step"]["east"] for k in "abc"}
    util, util_fixed = ratio(east["a"], east["c"]), ratio(east["a"], east["b"])
    gap = ratio(runs["c"]["eval_loss"] - runs["e"]["eval_loss"], runs["e"]["eval_loss"])
    gap_fixed = ratio(runs["b"]["eval_loss"] - runs["d"]["eval_loss"], runs["d"]["eval_loss"])
    slowdown = ratio(runs["c"]["s_per_step"]["west"], east["c"])
    summary = {
        "fast_cluster_utilization": round(util or 0, 3),
        "fast_cluster_utilization_fixed_h": round(util_fixed or 0, 3),
        "loss_gap": round(gap or 0, 4), "loss_gap_fixed_h": round(gap_fixed or 0, 4),
        "slowdown": round(slowdown or 0, 2),
        "params_identical": all(r["identical"] for r in runs.values()),
        "every_s": every, "inner_steps": h, "codec": args.codec, "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum, "seed": args.seed,
        "steps": n, "slow_steps_time_based": slow_steps, "date": started,
        "load": os.getloadavg()[0], "quick": args.quick,
        "goals_met": {"fast_cluster_utilization": (util or 0) >= GOALS[
            "fast_cluster_utilization"], "loss_gap": (gap if gap is not None else 1) <= GOALS[
            "loss_gap"]},
        "runs": runs}
    print()
    print(table(["job", "east s/step", "west s/step", "east steps", "west steps", "eval loss",
                 "joint rounds"],
                [[runs[k]["job"], runs[k]["s_per_step"].get("east"),
                  runs[k]["s_per_step"].get("west"), runs[k]["steps"].get("east"),
                  runs[k]["steps"].get("west"), runs[k]["eval_loss"], runs[k]["joint_rounds"]]
                 for k in "abc"] + [[runs[k]["job"], runs[k]["s_per_step"].get("flat"), None,
                                     runs[k]["steps"].get("flat"), None, runs[k]["eval_loss"],
                                     None] for k in "de"]))
    print()
    print(f"fast_cluster_utilization  time-based {util:.3f}   fixed H {util_fixed:.3f}   "
          f"(goal >= {GOALS['fast_cluster_utilization']})")
    print(f"loss gap vs flat          time-based {gap:.2%}   fixed H {gap_fixed:.2%}   "
          f"(goal <= {GOALS['loss_gap']:.0%})")
    print(f"west's slowdown (c)       {slowdown:.2f}x; east's share of the weights "
          f"{runs['c'].get('weight_east_share')}")
    if args.quick:
        print("(--quick: too few rounds to resolve a few percent of utilisation or loss)")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
