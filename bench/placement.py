"""Placement search on the paper's two scenarios (8 stages x 8 replicas, 64 devices), against
the paper's final scores, the lower bound and the two baselines.

For each scenario: nebula's score, the paper's, the lower bound (bounds.py), the best of 100
random placements and local search alone at the same budget, the evaluations nebula used, its
wall time, and nebula / paper. Two hand-made placements are shown for scale: "blocks" (each
site holds a contiguous run of stages, replicas inside one site) and "striped" (every stage
spread evenly over the sites, so each replica's pipeline stays inside one site). With --json
the last line is one JSON object.

With --scale: synthetic multi-region networks (scenarios.random_sites, network seed = --seed) of
64 / 256 / 1,024 / 4,096 devices (4 x 16, 8 x 32, 8 x 128, 16 x 256 sites x devices; 8, 16, 32,
64 stages): wall time (network, lower bound, search and baselines), nebula's search time and
evaluations per second, its score, the lower bound and the gap, the best of 100 random balanced
placements and local search alone (same budget and time limit), and nebula / random.

    .venv/bin/python bench/placement.py [--budget 5000] [--seed 0] [--json]
    .venv/bin/python bench/placement.py --scale [--sizes 64,256,1024,4096] [--time-limit S]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from nebula_cli.planner.costmodel import CostModel
from nebula_cli.planner.placement import plan_placement
from nebula_cli.planner.scenarios import PAPER_SCENARIOS, Scenario, random_sites

SCALES = {64: (4, 16, 8), 256: (8, 32, 16), 1024: (8, 128, 32), 4096: (16, 256, 64)}
"""devices -> (sites, devices per site, stages)."""


def hand_made(scenario: Scenario) -> dict[str, float]:
    """Scores of the blocks and striped placements (devices are listed site after site)."""
    model = CostModel(scenario.network, scenario.task)
    t = scenario.task
    n = t.devices
    sites: dict[str, list[int]] = {}
    for i, name in enumerate(scenario.network.devices):
        sites.setdefault(str(name).rsplit("-", 1)[0], []).append(i)
    blocks = [list(range(j * t.dp, (j + 1) * t.dp)) for j in range(t.stages)]
    # striped: every group takes the same share of every site
    striped: list[list[int]] = [[] for _ in range(t.stages)]
    for members in sites.values():
        for k, dev in enumerate(members):
            striped[k * t.stages // len(members)].append(dev)
    out = {"blocks": model.cost(blocks).score}
    if all(len(g) == t.dp for g in striped) and sum(map(len, striped)) == n:
        out["striped"] = model.cost(striped).score
    return out


def run(budget: int, seed: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, make in PAPER_SCENARIOS.items():
        sc = make()
        start = time.perf_counter()
        res = plan_placement(sc.network, sc.task, budget=budget, seed=seed)
        total = time.perf_counter() - start
        cost = res.placement.cost
        results[name] = {
            "title": sc.title,
            "nebula": cost.score,
            "data_cost_s": cost.data,
            "pipeline_cost_s": cost.pipeline,
            "paper": sc.paper_score,
            "random": res.baselines["random"],
            "local_search": res.baselines["local_search"],
            "evaluations": res.evaluations,
            "seconds": res.seconds,
            "seconds_with_baselines": total,
            "ratio_vs_paper": cost.score / sc.paper_score if sc.paper_score else None,
            "lower_bound_s": res.lower_bound,
            "gap": res.gap,
            "hand_made": hand_made(sc),
            "stages": res.placement.stages,
        }
    return results


def run_scale(sizes: list[int], budget: int, seed: int,
              time_limit: float | None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for n in sizes:
        sites, per_site, stages = SCALES[n]
        start = time.perf_counter()
        sc = random_sites(sites, per_site, stages, seed=seed)
        res = plan_placement(sc.network, sc.task, budget=budget, seed=seed,
                             time_limit=time_limit)
        total = time.perf_counter() - start
        score = res.placement.cost.score
        rand = res.baselines["random"]
        results[str(n)] = {
            "title": sc.title, "stages": stages, "dp": sc.task.dp, "wall_s": total,
            "search_s": res.seconds, "evaluations": res.evaluations,
            "evaluations_per_s": res.evaluations_per_s, "timed_out": res.timed_out,
            "score": score, "lower_bound_s": res.lower_bound, "gap": res.gap,
            "random": rand, "local_search": res.baselines["local_search"],
            "baseline_evaluations": res.baseline_evaluations,
            "baseline_seconds": res.baseline_seconds,
            "ratio_vs_random": score / rand if rand else None,
        }
        print(f"{n} devices: {json.dumps(results[str(n)])}", file=sys.stderr, flush=True)
    return results


def print_scale(results: dict[str, Any], args: argparse.Namespace) -> None:
    limit = f", time limit {args.time_limit:g} s" if args.time_limit else ""
    table = Table(title=f"placement at scale, budget {args.budget}{limit}, seed {args.seed}, "
                        f"{os.cpu_count()} cores; scores in s; random = best of 100 random "
                        "balanced placements; gap = (score - bound) / score")
    for col in ("devices", "stages x dp", "wall s", "search s", "evals", "evals/s", "nebula",
                "lower bound", "gap", "random", "local search", "nebula/random"):
        table.add_column(col, justify="right")
    for n, r in results.items():
        table.add_row(n, f"{r['stages']} x {r['dp']}", f"{r['wall_s']:.1f}",
                      f"{r['search_s']:.1f}", str(r["evaluations"]),
                      f"{r['evaluations_per_s']:.0f}", f"{r['score']:.3f}",
                      f"{r['lower_bound_s']:.3f}", f"{100 * r['gap']:.1f} %",
                      f"{r['random']:.3f}", f"{r['local_search']:.3f}",
                      f"{r['ratio_vs_random']:.3f}")
    Console(highlight=False, width=None if sys.stdout.isatty() else 150).print(table)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=5000, help="evaluations per search")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--scale", action="store_true",
                        help="synthetic networks of 64 to 4,096 devices instead")
    parser.add_argument("--sizes", default="64,256,1024,4096",
                        help="with --scale: comma-separated device counts among "
                             f"{', '.join(map(str, SCALES))}")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="with --scale: seconds per search (nebula and each baseline)")
    args = parser.parse_args(argv)
    if args.scale:
        sizes = [int(x) for x in args.sizes.split(",")]
        bad = [n for n in sizes if n not in SCALES]
        if bad:
            parser.error(f"--sizes: {bad} not among {list(SCALES)}")
        scale = run_scale(sizes, args.budget, args.seed, args.time_limit)
        print_scale(scale, args)
        if args.json:
            print(json.dumps({"budget": args.budget, "seed": args.seed,
                              "time_limit": args.time_limit, "scale": scale}))
        return scale

    results = run(args.budget, args.seed)
    table = Table(title=f"placement, 8 stages x 8 replicas, budget {args.budget} evaluations, "
                        f"seed {args.seed}, {os.cpu_count()} cores; scores in s "
                        "(data + 2 x pipeline); random: best of 100; blocks / striped: hand-made "
                        "placements")
    for col in ("scenario", "nebula", "paper", "lower bound", "random", "local search",
                "evaluations", "seconds", "nebula/paper", "blocks", "striped"):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for name, r in results.items():
        hm = r["hand_made"]
        table.add_row(name, f"{r['nebula']:.4f}", f"{r['paper']:.2f}", f"{r['lower_bound_s']:.4f}",
                      f"{r['random']:.4f}", f"{r['local_search']:.4f}", str(r["evaluations"]),
                      f"{r['seconds']:.1f}", f"{r['ratio_vs_paper']:.4f}",
                      f"{hm['blocks']:.4f}", f"{hm.get('striped', float('nan')):.4f}")
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    console.print(table)
    if args.json:
        print(json.dumps({"budget": args.budget, "seed": args.seed, "scenarios": results}))
    return results


if __name__ == "__main__":
    main()
