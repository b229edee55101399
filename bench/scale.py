"""Models of the size users train (issue 42): each process's outer-step memory against its
shard's fp32 bytes, and each outer round's time against its bound, side by side per model size,
for today's outer step (the ranks' outer state sharded, runtime/shard.py; the relay and rank 0's
hop to it still whole; the old single-buffer path is recorded in docs/benchmarks.md).

    .venv/bin/python bench/scale.py [--quick] [--json] [--sizes 1.3M,20M,100M]
        [--codecs int8,topk] [--links 1g,10g] [--ranks 2] [--inner-steps 4] [--rounds 3]
        [--seed 1234]

Two clusters (east, west) of --ranks local hosts each (one CPU rank per host, ZeRO 0, `nebula
launch` with the local transport: every process on this machine, every byte on loopback) train
examples/gpt widened to each size (train.py's --d-model/--n-layer/--n-head; micro batch 4,
context 128) for H x --rounds steps, through the relays (DiLoCo, error feedback, each codec,
the relays' own WAN emulation of each link: a rate each way and a one-way delay); and the same
job without `relay:` once per size (the ranks' baseline). A process is a relay or a rank; its
peak is sampled from /proc every 0.2 s (bench/_scale_sampler.py).

- outer-step memory: a process's peak (VmHWM plus its memfd/shm mappings not already resident
  in it; `peak_issue` adds every mapping, issue 42's wording, which counts a touched shared
  page twice) minus the same process's peak in the job without `relay:` (a rank) or its peak
  before round 1 (a relay); `vs_shard`: that over its shard's fp32 bytes
  (planner/outer_memory.py's `shard_elements`: the whole vector on this path).
- a round: from the last cluster's contribution (the latest start of the round on any cluster's
  rank 0) to the average applied on every cluster's rank 0 (the latest end); its bound: the
  larger of the link's time (the busiest relay's bytes / rate + 1 RTT) and this machine's
  (bench/_scale_machine.py: copies, encode, decode and AES-GCM of the same bytes on one thread,
  measured in the same run; a floor: error feedback and the delay line left out).
- cost per round: round_s = a + b * params / ranks fitted over the sizes (int8, the first
  link) on each job's steady rounds (`round_s_steady`: the mean after the first, whose first
  mappings of shared memory cost 2-3x; `round_s_mean` keeps every round); the goal's 15 %
  needs three sizes or more.

The last line with --json is one JSON object (JSON_FIELDS first; keys not measured by this run
are null and `missing` says why). --quick: sizes 1.3M and 20M, link 1g, codecs int8 and topk,
2 ranks per cluster, H 4, 3 rounds (about 7 minutes here).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _scale_figures as figures  # noqa: E402
import _scale_jobs as jobs  # noqa: E402
from _bed import table  # noqa: E402
from _local import REPO, Cli  # noqa: E402
from _scale_machine import MachineRound, measure  # noqa: E402

sys.path.insert(0, str(REPO))
from nebula_cli.planner.outer_memory import (  # noqa: E402
    COPIES,
    FP32_BYTES,
    SHARED_COPIES,
    ProcessRole,
    shard_elements,
)

JSON_FIELDS = ("sizes", "max_outer_memory_vs_shard", "round_time_vs_bound_1g",
               "round_time_vs_bound_10g", "largest_params", "identical", "goals_met")
"""Keys of the JSON object printed last with --json, first (then missing, fit, extrapolated,
settings)."""
MODELS = {m.label: m for m in (jobs.Model("1.3M", 160, 4, 4), jobs.Model("20M", 512, 6, 8),
                               jobs.Model("100M", 768, 14, 12))}
LINKS = {k.label: k for k in (jobs.Link("1g", 1000.0, 10.0), jobs.Link("10g", 10000.0, 50.0))}
GOALS = {"outer_memory_vs_shard": 3.0, "round_time_vs_bound_1g": 1.2,
         "round_time_vs_bound_10g": 1.5, "linear_cost": 0.15}
QUICK = {"sizes": "1.3M,20M", "codecs": "int8,topk", "links": "1g"}
FULL = {"sizes": "1.3M,20M,100M", "codecs": "int8,topk", "links": "1g,10g"}
MICRO_BATCH = 4
EXTRAPOLATE = (7_000_000_000, 70_000_000_000)
STEP_S_PER_PARAM = 3.2e-8
"""One rank's step here on one thread at micro batch 4 (0.6 s at 19 M): the wall-time guess."""
JOB_OVERHEAD_S = 45.0
"""A job's launch, DeepSpeed's start-up and its stop, here."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--quick", action="store_true",
                   help="sizes 1.3M and 20M, link 1g (under 15 minutes here)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--sizes", default=None, help=f"of {', '.join(MODELS)}")
    p.add_argument("--codecs", default=None, help="int8, topk")
    p.add_argument("--links", default=None, help=f"of {', '.join(LINKS)}")
    p.add_argument("--ranks", type=int, default=2, help="ranks (local hosts) per cluster")
    p.add_argument("--inner-steps", type=int, default=4, help="H (at most 4 in the issue)")
    p.add_argument("--rounds", type=int, default=3, help="outer rounds per job")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.size_list = (args.sizes or preset["sizes"]).split(",")
    args.codec_list = (args.codecs or preset["codecs"]).split(",")
    args.link_list = (args.links or preset["links"]).split(",")
    for name in args.size_list:
        if name not in MODELS:
            p.error(f"unknown size {name!r} (known: {', '.join(MODELS)})")
    for name in args.link_list:
        if name not in LINKS:
            p.error(f"unknown link {name!r} (known: {', '.join(LINKS)})")
    if args.inner_steps < 2 or args.rounds < 1 or args.ranks < 1:
        p.error("--inner-steps must be at least 2, --rounds and --ranks at least 1")
    return args


def job_specs(args: argparse.Namespace) -> list[jobs.JobSpec]:
    """Per size: the job without `relay:` first, then one per codec and link."""
    out = []
    for size in args.size_list:
        base = dict(model=MODELS[size], ranks=args.ranks, steps=args.inner_steps * args.rounds,
                    inner_steps=args.inner_steps, seed=args.seed, micro_batch=MICRO_BATCH)
        out.append(jobs.JobSpec(codec=None, link=None, **base))
        out += [jobs.JobSpec(codec=c, link=LINKS[k], **base)
                for c in args.codec_list for k in args.link_list]
    return out


def approx_params(m: jobs.Model) -> int:
    """The GPT's parameters, near enough for the wall-time guess (12 d^2 per layer)."""
    return 12 * m.n_layer * m.d_model ** 2 + 2 * 256 * m.d_model + 128 * m.d_model


def expected_s(spec: jobs.JobSpec) -> float:
    """A guess of one job's wall time here: its overhead and its steps, the ranks of both
    clusters sharing this machine's cores."""
    share = max(1.0, 2 * spec.ranks / (os.cpu_count() or 1))
    step = max(0.15, approx_params(spec.model) * STEP_S_PER_PARAM * share)
    return JOB_OVERHEAD_S + spec.steps * step


@dataclass(frozen=True)
class ProcessFigure:
    """One process's outer-step memory in one job."""

    cluster: str
    role: str
    rank: int | None
    peak_bytes: int
    peak_issue_bytes: int
    baseline_bytes: int | None
    outer_bytes: int | None
    outer_memory_vs_shard: float | None
    outer_memory_vs_shard_issue: float | None
    shared_bytes: int
    model_copies: float
    """planner/outer_memory.py's copies for the role (own + shared), beside the measured."""


@dataclass(frozen=True)
class RoundFigure:
    round: int
    seconds: float
    relay_s: float
    wan_bytes: int
    link_s: float
    machine_s: float
    vs_bound: float
    binds: str


def process_figures(run: jobs.JobRun, baseline: jobs.JobRun | None) -> list[ProcessFigure]:
    """Each relay and rank of `run`, its outer-step memory against its shard."""
    out = []
    for (cluster, role_name, rank), who in sorted(run.peaks.items(),
                                                  key=lambda kv: (kv[0][0], kv[0][2] or -1)):
        role = who.role
        if role is ProcessRole.RELAY:
            base, base_issue = who.idle, who.idle_issue
        else:
            other = baseline.peaks.get((cluster, role_name, rank)) if baseline else None
            base = other.peak if other else None
            base_issue = other.peak_issue if other else None
        outer = figures.outer_step_bytes(who.peak, base) if base is not None else None
        outer_issue = (figures.outer_step_bytes(who.peak_issue, base_issue)
                       if base_issue is not None else None)
        out.append(ProcessFigure(
            cluster=cluster, role=role.value, rank=rank, peak_bytes=who.peak,
            peak_issue_bytes=who.peak_issue, baseline_bytes=base, outer_bytes=outer,
            outer_memory_vs_shard=(round(figures.vs_shard(outer, run.params, run.spec.ranks,
                                                          role), 3)
                                   if outer is not None and run.params else None),
            outer_memory_vs_shard_issue=(round(figures.vs_shard(outer_issue, run.params,
                                                                run.spec.ranks, role), 3)
                                         if outer_issue is not None and run.params else None),
            shared_bytes=who.shared, model_copies=COPIES[role] + SHARED_COPIES[role]))
    return out


def round_figures(run: jobs.JobRun, machine: MachineRound) -> list[RoundFigure]:
    link = run.spec.link
    assert link is not None
    out = []
    for r in run.rounds:
        link_s = figures.link_bound_s(r.wan_bytes, link.rate_mbit, link.rtt_ms)
        vs, binds = figures.round_vs_bound(r.seconds, link_s, machine.seconds)
        out.append(RoundFigure(r.round, round(r.seconds, 4), round(r.relay_s, 4), r.wan_bytes,
                               round(link_s, 4), round(machine.seconds, 4), round(vs, 3), binds))
    return out


def overall(rounds: list[RoundFigure]) -> float | None:
    """A job's round time against its bound: all its rounds' time over all their bounds."""
    if not rounds:
        return None
    bound = sum(max(r.link_s, r.machine_s) for r in rounds)
    return round(sum(r.seconds for r in rounds) / bound, 3)


def run_figures(run: jobs.JobRun, baseline: jobs.JobRun | None,
                machine: MachineRound) -> dict[str, Any]:
    procs = process_figures(run, baseline)
    rounds = round_figures(run, machine)
    worst = [p.outer_memory_vs_shard for p in procs if p.outer_memory_vs_shard is not None]
    assert run.spec.link is not None
    return {"codec": run.spec.codec, "link": run.spec.link.label, "job_state": run.state,
            "identical": run.identical, "wall_s": round(run.wall_s, 1), "samples": run.samples,
            "round_time_vs_bound": {run.spec.link.label: overall(rounds)},
            "round_s_mean": (round(sum(r.seconds for r in rounds) / len(rounds), 4)
                             if rounds else None),
            "round_s_steady": figures.steady_round_s([r.seconds for r in rounds]),
            "max_outer_memory_vs_shard": max(worst) if worst else None,
            "tokens_per_s": run.tokens_per_s,
            "processes": [asdict(p) for p in procs], "rounds": [asdict(r) for r in rounds],
            "machine": asdict(machine) | {"seconds": round(machine.seconds, 4)}}


def summarize(per_size: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON object (JSON_FIELDS first)."""
    missing = ["identical: every worker against every other only; the reference (the outer "
               "step written out by hand in a test helper) is not built yet",
               "tokens/s against the same job with the relays' link unshaped: not run"]
    largest = max(per_size, key=lambda s: s["params"]) if per_size else None
    runs = largest["runs"] if largest else []
    worst = [r["max_outer_memory_vs_shard"] for r in runs
             if r["max_outer_memory_vs_shard"] is not None]

    def vs_bound(link: str) -> float | None:
        got = [r["round_time_vs_bound"].get(link) for r in runs
               if r["codec"] == "int8" and r["link"] == link]
        return got[0] if got else None

    g1, g10 = vs_bound("1g"), vs_bound("10g")
    if g10 is None:
        missing.append("round_time_vs_bound_10g: the 10 Gbit/s / 50 ms link not run"
                       + (" (--quick: one link)" if args.quick else ""))
    if largest and largest["label"] != "100M" or args.quick:
        missing.append("the ~100 M model and the largest this machine holds (>= 300 M): not run "
                       "(--quick: 1.3 M and 20 M)")
    missing.append("one stream against N streams with a real TCP window: the relays' WAN "
                   "emulation paces one stream; not measured")
    points = []
    for s in per_size:
        for r in s["runs"]:
            if r["codec"] == "int8" and r["link"] == args.link_list[0] and r["round_s_steady"]:
                points.append((s["params"], args.ranks, r["round_s_steady"]))
    fit = None
    if len(points) >= 2:
        a, b, worst_miss = figures.linear_cost(points)
        fit = {"a_s": round(a, 4), "b_s_per_param_per_rank": b, "worst_miss": round(worst_miss, 4),
               "points": len(points), "link": args.link_list[0]}
    linear_met = (fit["worst_miss"] <= GOALS["linear_cost"]
                  if fit and fit["points"] >= 3 else None)
    if linear_met is None:
        missing.append("linear cost goal: needs three sizes or more (any line fits two)")
    max_vs = max(worst) if worst else None
    out: dict[str, Any] = {
        "sizes": per_size,
        "max_outer_memory_vs_shard": max_vs,
        "round_time_vs_bound_1g": g1,
        "round_time_vs_bound_10g": g10,
        "largest_params": largest["params"] if largest else None,
        "identical": all(r["identical"] for s in per_size for r in s["runs"]) and bool(per_size),
        "goals_met": {
            "outer_memory_vs_shard": (max_vs <= GOALS["outer_memory_vs_shard"]
                                      if max_vs is not None else None),
            "round_time_vs_bound_1g": (g1 <= GOALS["round_time_vs_bound_1g"]
                                       if g1 is not None else None),
            "round_time_vs_bound_10g": (g10 <= GOALS["round_time_vs_bound_10g"]
                                        if g10 is not None else None),
            "linear_cost": linear_met},
        "missing": missing,
        "fit": fit,
        "extrapolated": extrapolate(largest, fit),
        "path": ("ranks sharded (runtime/shard.py: each rank its shard of the outer state); "
                 "the relay and rank 0's hop whole"),
        "settings": {"quick": args.quick, "sizes": args.size_list, "codecs": args.codec_list,
                     "links": {k: asdict(LINKS[k]) for k in args.link_list},
                     "ranks": args.ranks, "inner_steps": args.inner_steps,
                     "rounds": args.rounds, "seed": args.seed, "micro_batch": MICRO_BATCH,
                     "zero_stage": 0, "cores": os.cpu_count()}}
    return out


def extrapolate(largest: dict[str, Any] | None, fit: dict[str, Any] | None
                ) -> dict[str, Any] | None:
    """GB per process at 7 B and 70 B on this path (each role's outer bytes per parameter at
    the largest size measured, int8, times the parameters: the whole vector in every process,
    whatever the ranks), and seconds per round at the fitted link (a + b * params / ranks, the
    ranks of the fit: one relay per cluster moves the whole vector on this path, whatever the
    cluster's size). None without the largest size's figures."""
    if not largest:
        return None
    runs = [r for r in largest["runs"] if r["codec"] == "int8"] or largest["runs"]
    per_role: dict[str, float] = {}
    for p in runs[0]["processes"]:
        if p["outer_bytes"] is not None:
            per_role[p["role"]] = max(per_role.get(p["role"], 0.0),
                                      p["outer_bytes"] / largest["params"])
    out: dict[str, Any] = {}
    for n in EXTRAPOLATE:
        out[f"{n // 1_000_000_000}B"] = {
            "gb_per_process": {role: round(v * n / 1e9, 1) for role, v in per_role.items()},
            "round_s_1g": (round(fit["a_s"] + fit["b_s_per_param_per_rank"] * n
                                 / largest["ranks"], 1) if fit else None),
            "round_s_10g": None}
    return out


def show(summary: dict[str, Any]) -> None:
    rows = []
    for s in summary["sizes"]:
        for r in s["runs"]:
            for p in r["processes"]:
                rows.append([f"{s['label']} {r['codec']} {r['link']}",
                             f"{p['cluster']} {p['role']}" + (
                                 f" {p['rank']}" if p['role'] == ProcessRole.RANK.value else ""),
                             round(p["peak_bytes"] / 1e6), round(p["shared_bytes"] / 1e6),
                             None if p["baseline_bytes"] is None
                             else round(p["baseline_bytes"] / 1e6),
                             None if p["outer_bytes"] is None else round(p["outer_bytes"] / 1e6),
                             p["outer_memory_vs_shard"], p["outer_memory_vs_shard_issue"],
                             p["model_copies"]])
    print(table(["job", "process", "peak MB", "shm MB", "baseline MB", "outer MB",
                 "vs shard", "vs shard (issue)", "model copies"], rows))
    print()
    rows = []
    for s in summary["sizes"]:
        for r in s["runs"]:
            for rd in r["rounds"]:
                rows.append([f"{s['label']} {r['codec']} {r['link']}", rd["round"],
                             rd["seconds"], rd["relay_s"], round(rd["wan_bytes"] / 1e6, 2),
                             rd["link_s"], rd["machine_s"], rd["vs_bound"], rd["binds"]])
    print(table(["job", "round", "round s", "relay s", "WAN MB", "link s", "machine s",
                 "vs bound", "binds"], rows))
    print()
    rows = [[f"{s['label']} ({s['params']:,})", r["codec"], r["link"], r["job_state"],
             r["identical"], r["max_outer_memory_vs_shard"],
             r["round_time_vs_bound"][r["link"]], r["round_s_mean"],
             None if r["tokens_per_s"] is None else round(r["tokens_per_s"]), r["wall_s"]]
            for s in summary["sizes"] for r in s["runs"]]
    print(table(["size", "codec", "link", "state", "identical", "worst vs shard",
                 "round/bound", "round s", "tokens/s", "wall s"], rows))
    fit = summary["fit"]
    if fit:
        print(f"\nround_s = a + b * params / ranks: a {fit['a_s']} s, b "
              f"{fit['b_s_per_param_per_rank']:.3e} s (int8, {fit['link']}, {fit['points']} "
              f"sizes, worst miss {fit['worst_miss']:.1%})")
    ext = summary["extrapolated"]
    if ext:
        print("extrapolated on this path: " + "; ".join(
            f"{k}: " + ", ".join(f"{role} {gb} GB" for role, gb in v["gb_per_process"].items())
            + (f", a round at 1 Gbit/s {v['round_s_1g']} s" if v["round_s_1g"] else "")
            for k, v in ext.items()))
    print(f"\nmax_outer_memory_vs_shard {summary['max_outer_memory_vs_shard']} (goal <= "
          f"{GOALS['outer_memory_vs_shard']:g}), round_time_vs_bound_1g "
          f"{summary['round_time_vs_bound_1g']} (goal <= {GOALS['round_time_vs_bound_1g']:g}), "
          f"identical {summary['identical']}, goals_met {summary['goals_met']}")
    for m in summary["missing"]:
        print(f"missing: {m}")


def stop_every_job(cli: Cli) -> None:
    """Every job under the bench's NEBULA_HOME stopped (--force), whatever its state."""
    for job in sorted((cli.home / "jobs").glob("*")):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            cli("stop", job.name, "--force", timeout=300)


def terminate(*_: object) -> None:
    """SIGTERM: unwind (every job stopped), deaf to a second one while that runs."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, terminate)
    specs = job_specs(args)
    guess = sum(expected_s(s) for s in specs)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    print(table(["job", "params (approx.)", "ranks/cluster", "steps", "H", "codec", "link",
                 "expected s"],
                [[s.name, f"{approx_params(s.model):,}", s.ranks, s.steps, s.inner_steps,
                  s.codec or "(no relay)",
                  f"{s.link.rate_mbit:g} Mbit/s, {s.link.delay_ms:g} ms" if s.link else "",
                  round(expected_s(s))] for s in specs]))
    print(f"\n{len(specs)} jobs, expected wall time about {guess / 60:.0f} min "
          f"(started {started})", flush=True)
    per_size: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="nebula-scale-") as tmp, \
            contextlib.ExitStack() as stack:
        cli = Cli(Path(tmp) / "home")
        stack.callback(stop_every_job, cli)
        by_size: dict[str, dict[str, Any]] = {}
        baseline: jobs.JobRun | None = None
        machines: dict[tuple[int, str], MachineRound] = {}
        for spec in specs:
            print(f"[{time.strftime('%H:%M:%S')}] {spec.name} ...", flush=True)
            run = jobs.run(cli, Path(tmp), spec, timeout=900)
            print(f"  {run.state} in {run.wall_s:.0f} s, {run.params:,} parameters, "
                  f"{len(run.rounds)} rounds, {len(run.peaks)} processes sampled "
                  f"({run.samples} samples)"
                  + (f", identical {run.identical}" if spec.codec else ""), flush=True)
            if run.state != "SUCCEEDED":
                raise SystemExit(f"{spec.name}: job {run.job_id} ended {run.state}")
            size = by_size.setdefault(spec.model.label, {
                "label": spec.model.label, "params": run.params, "ranks": spec.ranks,
                "shard_fp32_bytes": {r.value: shard_elements(run.params, spec.ranks, r)
                                     * FP32_BYTES for r in ProcessRole},
                "runs": []})
            if spec.codec is None:
                baseline = run
                size["baseline"] = {
                    "job_state": run.state, "wall_s": round(run.wall_s, 1),
                    "tokens_per_s": run.tokens_per_s,
                    "peaks": [{"cluster": c, "role": r, "rank": k, "peak_bytes": p.peak,
                               "peak_issue_bytes": p.peak_issue}
                              for (c, r, k), p in sorted(run.peaks.items(),
                                                         key=lambda kv: str(kv[0]))]}
                continue
            key = (run.params, spec.codec)
            if key not in machines:
                machines[key] = measure(run.params, spec.codec)
            size["runs"].append(run_figures(run, baseline, machines[key]))
        per_size = list(by_size.values())
    summary = summarize(per_size, args)
    summary["date"] = started
    summary["wall_s_expected"] = round(guess)
    print()
    show(summary)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
