"""Placement search on the paper's two scenarios (8 stages x 8 replicas, 64 devices), against
the paper's final scores and the two baselines at the same budget.

For each scenario: nebula's score, the paper's, random partitions and local search alone at the
same budget, the evaluations nebula used, its wall time, and nebula / paper. Two hand-made
placements are shown for scale: "blocks" (each site holds a contiguous run of stages, replicas
inside one site) and "striped" (every stage spread evenly over the sites, so each replica's
pipeline stays inside one site). With --json the last line is one JSON object.

    .venv/bin/python bench/placement.py [--budget 5000] [--seed 0] [--json]
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
from nebula_cli.planner.scenarios import PAPER_SCENARIOS, Scenario


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
            "hand_made": hand_made(sc),
            "stages": res.placement.stages,
        }
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=5000, help="evaluations per search")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)

    results = run(args.budget, args.seed)
    table = Table(title=f"placement, 8 stages x 8 replicas, budget {args.budget} evaluations, "
                        f"seed {args.seed}, {os.cpu_count()} cores; scores in s "
                        "(data + 2 x pipeline); blocks / striped: hand-made placements")
    for col in ("scenario", "nebula", "paper", "random", "local search", "evaluations",
                "seconds", "nebula/paper", "blocks", "striped"):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for name, r in results.items():
        hm = r["hand_made"]
        table.add_row(name, f"{r['nebula']:.4f}", f"{r['paper']:.2f}",
                      f"{r['random']:.4f}", f"{r['local_search']:.4f}", str(r["evaluations"]),
                      f"{r['seconds']:.1f}", f"{r['ratio_vs_paper']:.4f}",
                      f"{hm['blocks']:.4f}", f"{hm.get('striped', float('nan')):.4f}")
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 130)
    console.print(table)
    if args.json:
        print(json.dumps({"budget": args.budget, "seed": args.seed, "scenarios": results}))
    return results


if __name__ == "__main__":
    main()
