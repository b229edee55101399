"""Adaptive sync: ``inner_steps: auto`` against a fixed H when the link's rate is cut 4x in the
middle of a run and restored later (test bed, root).

    .venv/bin/python bench/adaptive.py [--quick] [--json] [--mbit 20] [--cut 4] [--steps 1500]
                                       [--inner-steps 10] [--codec int8] [--target 0.95]
                                       [--no-auto-codec] [--tcp reno]

One test bed: clusters east (e1) and west (w1), one CPU worker each, the east-west link shaped to
--mbit by the bed's tc, and 25 ms each way added by the relays. Three jobs of the same GPT
(examples/gpt), seed and number of steps:

  (c) reference  a round only at the end, link unshaped: the seconds per step of training alone
  (f) fixed H    a round every --inner-steps steps
  (a) auto       ``inner_steps: auto`` with target_utilization --target (H from --min-h)
  (x) auto codec (a) with ``compression: auto`` too (the relays choose int8 or topk each round;
                 each codec's own outer settings); left out with --no-auto-codec

In (f), (a) and (x) the link is cut to --mbit / --cut when the slower worker reaches 1/3 of the
steps (tc, while the job runs) and restored at 2/3. Utilisation over a window of steps = that many
steps of (c)'s seconds per step / the window's wall time (the workers' own timestamps, every
10 steps): ``utilization_after_cut`` is the window from the cut to the end of the run (the issue's
"rest of the run"), also split into the cut phase and the restored phase; ``h_trace`` the H
each round of (a) chose (the relays' ``next_h``); ``codec_trace`` the codec each round of (x)
used. The codec defaults to int8 so that a round's
bytes take long enough on the link to matter (topk's 66 KB rounds hardly feel a 5 Mbit/s link
at this model size). The hosts' TCP is reno unless --tcp says otherwise (as in
bench/relay_goodput.py: loss-based like Linux's default cubic; --tcp system keeps this machine's
own, bbr, which on the bed's links without base delay slows the relays' duplex connections).
Goal (issue 14): utilization_after_cut >= 0.9 with auto, and H back down
after the rate is restored.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bed  # noqa: E402
import _clusters  # noqa: E402

JSON_FIELDS = ("utilization_after_cut", "utilization_after_cut_fixed_h", "h_trace",
               "utilization_after_cut_auto_codec", "codec_trace")
"""Keys of the JSON object printed last with --json, first (then the detail)."""
GOAL = 0.9
QUICK = {"steps": 450}
AUTO_CODEC = "auto-codec"
CLUSTERS = {"east": ["e1"], "west": ["w1"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['steps']} steps (about 10 minutes; few rounds after the cut)")
    p.add_argument("--steps", type=int, default=None, help="steps of every job (1500)")
    p.add_argument("--mbit", type=float, default=20.0, help="the link's rate")
    p.add_argument("--cut", type=float, default=4.0, help="the rate is divided by this")
    p.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay (relays)")
    p.add_argument("--inner-steps", type=int, default=10, help="H of the fixed-H job")
    p.add_argument("--min-h", type=int, default=10, help="min_inner_steps of the auto job")
    p.add_argument("--target", type=float, default=None,
                   help="target_utilization of the auto job (default: the spec's)")
    p.add_argument("--codec", default="int8")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tcp", default=None,
                   help="the bed hosts' TCP congestion control, or 'system' for this machine's "
                        "(default: reno)")
    p.add_argument("--no-auto-codec", action="store_true",
                   help="leave out the job with compression: auto")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    args.steps = args.steps or (QUICK["steps"] if args.quick else 1500)
    args.tcp = args.tcp or _clusters.TCP
    args.tcp_label = args.tcp if args.tcp != "system" else f"system ({_clusters.system_tcp()})"
    args.tcp = None if args.tcp == "system" else args.tcp
    if args.steps < 30 or args.cut <= 1 or args.mbit <= 0:
        p.error("--steps >= 30, --cut > 1, --mbit > 0")
    return args


def sync_spec(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    if kind == "reference":
        return {"inner_steps": args.steps}
    if kind == "fixed":
        return {"inner_steps": args.inner_steps}
    auto: dict[str, Any] = {"inner_steps": "auto", "min_inner_steps": args.min_h,
                            "max_inner_steps": args.steps}
    if args.target is not None:
        auto["target_utilization"] = args.target
    return auto


def progress(job_id: str) -> int:
    """The slowest worker's newest logged step (0 before any)."""
    steps: dict[str, int] = {}
    for r in _bed.worker_records(job_id):
        if isinstance(r.get("step"), int) and "loss" in r:
            steps[r["cluster"]] = max(steps.get(r["cluster"], 0), r["step"])
    return min(steps.values()) if len(steps) == len(CLUSTERS) else 0


def run_job(neb: _bed.Nebula, bed: Any, tmp: Path, args: argparse.Namespace, kind: str
            ) -> dict[str, Any]:
    """One job; (f) and (a) with the link cut at 1/3 and restored at 2/3 of the steps."""
    run = (f"python -u train.py --steps {args.steps} --eval-every {args.steps} "
           f"--log-every 10 --seed {args.seed}")
    outer = {} if kind == AUTO_CODEC else {"outer_lr": 0.6, "outer_momentum": 0.5}
    relay = {"sync": {**outer, **sync_spec(args, "auto" if kind == AUTO_CODEC else kind)},
             "compression": {"codec": "auto" if kind == AUTO_CODEC else args.codec},
             "timeout": 600,
             "shaping": {"rate_mbit": None,
                         "delay_ms": 0.0 if kind == "reference" else args.delay_ms}}
    spec = _bed.ssh_spec(tmp / f"{kind}.yaml", bed, name=f"adaptive-{kind}", clusters=CLUSTERS,
                         run=run, relay=relay)
    bed.set_rate("east", "west", None if kind == "reference" else args.mbit)
    marks: dict[str, float] = {}
    before = set(neb.job_ids())
    done = threading.Event()

    def cutter() -> None:  # cut at 1/3 of the steps, restore at 2/3
        job = None
        while not done.wait(1.0):
            job = job or next(iter(set(neb.job_ids()) - before), None)
            step = progress(job) if job else 0
            if "cut" not in marks and step >= args.steps // 3:
                bed.set_rate("east", "west", args.mbit / args.cut)
                marks["cut"] = step
                _bed.say(f"step {step}: link cut to {args.mbit / args.cut:g} Mbit/s", "  ")
            elif "cut" in marks and "restore" not in marks and step >= 2 * args.steps // 3:
                bed.set_rate("east", "west", args.mbit)
                marks["restore"] = step
                _bed.say(f"step {step}: link restored", "  ")

    thread = threading.Thread(target=cutter, daemon=True)
    if kind != "reference":
        thread.start()
    _bed.say(f"{kind}: {args.steps} steps ...")
    try:
        job_id = neb.run_job(spec, timeout=600 + 10 * args.steps, log=tmp / f"{kind}.log")
    finally:
        done.set()
        if thread.is_alive():
            thread.join(5)
    records = _bed.worker_records(job_id)
    relays = _bed.relay_records(job_id)
    finals = [r for r in records if r.get("final")]
    return {"kind": kind, "records": records, "relays": relays, "marks": marks,
            "s_per_step": max(float(r["s_per_step"]) for r in finals),
            "identical": len({r["param_sha256"] for r in finals}) == 1,
            "eval_loss": finals[0]["eval_loss"], "load": os.getloadavg()[0]}


def window_s(records: list[dict[str, Any]], lo: float, hi: float) -> tuple[int, float]:
    """(steps, seconds) between the first logged step >= lo and the last <= hi, the slowest
    worker's timestamps (every 10 steps)."""
    spans = []
    for cluster in CLUSTERS:
        pts = sorted((r["step"], r["ts"]) for r in records if r.get("cluster") == cluster
                     and "loss" in r and isinstance(r.get("step"), int) and "ts" in r)
        inside = [p for p in pts if lo <= p[0] <= hi]
        if len(inside) >= 2:
            spans.append((inside[-1][0] - inside[0][0], inside[-1][1] - inside[0][1]))
    steps = min(s for s, _ in spans) if spans else 0
    return steps, max((t for _, t in spans), default=0.0)


def utilization(job: dict[str, Any], ref_s: float, lo: float, hi: float) -> float | None:
    steps, seconds = window_s(job["records"], lo, hi)
    return None if seconds <= 0 else round(steps * ref_s / seconds, 3)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _bed.require_bed()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="nebula-adaptive-") as tmp, \
            _bed.make_bed(CLUSTERS, rate_mbit=args.mbit, tcp=args.tcp) as bed:
        neb = _bed.Nebula(bed, Path(tmp) / "home")
        try:
            for kind in ("reference", "fixed", "auto", AUTO_CODEC)[
                    :3 if args.no_auto_codec else 4]:
                runs[kind] = run_job(neb, bed, Path(tmp), args, kind)
        finally:
            neb.cleanup()
    ref = runs["reference"]["s_per_step"]
    out: dict[str, Any] = {}
    for kind in [k for k in runs if k != "reference"]:
        job = runs[kind]
        cut, back = job["marks"].get("cut"), job["marks"].get("restore")
        if cut is None or back is None:
            raise SystemExit(f"{kind}: the run ended before the link was cut and restored")
        out[kind] = {"after_cut": utilization(job, ref, cut, args.steps),
                     "while_cut": utilization(job, ref, cut, back),
                     "restored": utilization(job, ref, back, args.steps),
                     "before_cut": utilization(job, ref, 0, cut),
                     "whole": round(ref / job["s_per_step"], 3)}
    auto = runs["auto"]
    trace = [(r["round"], r["next_h"]) for r in auto["relays"]
             if r.get("cluster") == "east" and r.get("next_h") is not None]
    cut_step, back_step = auto["marks"]["cut"], auto["marks"]["restore"]
    rounds_at = sorted({r["step"]: r["outer_round"] for r in auto["records"]
                        if r.get("cluster") == "east" and r.get("outer_round") is not None
                        and "next_inner_steps" in r}.items())
    h_at = [(step, r.get("next_inner_steps")) for r in auto["records"]
            for step in [r.get("step")] if r.get("cluster") == "east"
            and r.get("next_inner_steps") is not None]
    h_cut = max((h for s, h in h_at if cut_step <= s < back_step), default=None)
    h_end = h_at[-1][1] if h_at else None
    mixed = runs.get(AUTO_CODEC, {}).get("relays", [])
    codec_trace = [r.get("codec") for r in mixed if r.get("cluster") == "east"]
    summary = {
        "utilization_after_cut": out["auto"]["after_cut"],
        "utilization_after_cut_fixed_h": out["fixed"]["after_cut"],
        "h_trace": [h for _, h in trace],
        "utilization_after_cut_auto_codec": out.get(AUTO_CODEC, {}).get("after_cut"),
        "codec_trace": codec_trace,
        "h_trace_auto_codec": [r["next_h"] for r in mixed if r.get("cluster") == "east"
                               and r.get("next_h") is not None],
        "rounds_per_job": {k: len([r for r in v["relays"] if r.get("cluster") == "east"])
                           for k, v in runs.items()},
        "h_while_cut_max": h_cut, "h_at_end": h_end,
        "h_came_down": h_cut is not None and h_end is not None and h_end < h_cut,
        "utilization": out, "reference_s_per_step": round(ref, 4),
        "params_identical": all(r["identical"] for r in runs.values()),
        "eval_loss": {k: round(r["eval_loss"], 4) for k, r in runs.items()},
        "settings": {"steps": args.steps, "mbit": args.mbit, "cut": args.cut,
                     "delay_ms": args.delay_ms, "inner_steps": args.inner_steps,
                     "min_h": args.min_h, "target": args.target, "codec": args.codec,
                     "seed": args.seed, "quick": args.quick, "tcp": args.tcp_label},
        "marks": {k: r["marks"] for k, r in runs.items() if k != "reference"},
        "load": [round(r["load"], 2) for r in runs.values()],
        "goals_met": {"utilization_after_cut": (out["auto"]["after_cut"] or 0) >= GOAL},
        "rounds": len(rounds_at),
    }
    print()
    print(_bed.table(["job", "before cut", "while cut", "restored", "after cut (all)", "whole run"],
                     [[k, v["before_cut"], v["while_cut"], v["restored"], v["after_cut"],
                       v["whole"]] for k, v in out.items()]))
    print(f"\nutilization after the cut: auto {out['auto']['after_cut']}, fixed H "
          f"{args.inner_steps} {out['fixed']['after_cut']} (goal >= {GOAL} with auto)")
    print(f"H per round (auto): {summary['h_trace']}")
    if mixed:
        print(f"with compression: auto: utilization after the cut "
              f"{summary['utilization_after_cut_auto_codec']}, codec per round "
              f"{codec_trace}, H per round {summary['h_trace_auto_codec']}")
    print(f"rounds per job: {summary['rounds_per_job']}")
    print(f"H while cut (max) {h_cut}, at the end {h_end}: "
          f"{'came back down' if summary['h_came_down'] else 'did NOT come down'}")
    if args.quick:
        print("(--quick: few rounds after the cut; utilisation is not resolved to a few percent)")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
