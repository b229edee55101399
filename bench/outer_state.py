"""The ranks' outer-step memory and time, per rank, as the cluster's rank count grows (issue 42).

One cluster of N gloo ranks on this host runs OuterSync (runtime/sync.py) around a model of
1 M-value layers for a few rounds; rank 0's averager is a stand-in for the relay (it returns
half the cluster's delta, as a second cluster that made no progress would, and takes the
published state), so what is measured is the ranks' own part of the outer step: the read of
the fp32 master, the delta, the gather on rank 0, the scatter of the average, the outer step on
each shard, the write into the parameters, the published state. Per rank: the peak VmHWM above
the same process just before the sync was built, in copies of the whole fp32 vector, of its
own shard, and of its shard plus one streamed chunk of transients (the write's run of
parameters, `runtime/params.py`'s WRITE_CHUNK: 2^24 values, 64 MiB; at 20 M that chunk is most
of the vector, at 7 B 0.2 % of it), and the seconds one `after_step` with a round takes (mean
over the rounds after the first). The relay's own memory is bench/scale.py's.

    .venv/bin/python bench/outer_state.py [--quick] [--sizes 20,40] [--ranks 1,2,4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

JSON_FIELDS = ("runs", "max_rank_copies_of_shard", "max_rank0_copies_of_whole",
               "goals_met")
"""``max_rank_copies_of_shard``: the worst rank other than 0, against its shard plus one chunk."""
GOAL_COPIES_OF_SHARD = 3.0
"""Issue 42's goal: no process's outer-step memory above 3x its own shard's fp32 bytes."""
ROUNDS = 4
LAYER = 1_000_000
"""Values per layer of the model (one parameter each)."""


@dataclass
class RankFigures:
    size_m: int
    ranks: int
    rank: int
    copies_of_whole: float
    copies_of_shard: float
    copies_of_shard_and_chunk: float
    round_s: float


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rank_side(rank: int, world: int, size_m: int, store: str) -> dict[str, Any]:
    """One rank: build the model, train a step, then the sync and ROUNDS rounds."""
    import torch
    import torch.distributed as dist

    from nebula_cli.runtime.params import WRITE_CHUNK
    from nebula_cli.runtime.sync import OuterSync

    class HalfOfIt:  # the relay's stand-in: the average with a cluster that did not move
        def allreduce(self, round_id: int, tensor: Any, info: Any = None) -> Any:
            return _Result(0.5 * tensor, ["a", "b"], round_id)

        def publish_state(self, round_id: int, tensor: Any, momentum: Any = None) -> None:
            pass

        def close(self) -> None:
            pass

    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1000, LAYER // 1000, bias=False)
                                  for _ in range(size_m)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 1000)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    step()
    base = vm_hwm()
    sync = OuterSync(model, averager=HalfOfIt() if rank == 0 else None, inner_steps=1,
                     outer_lr=0.7, outer_momentum=0.9, nesterov=True, mode="diloco",
                     overlap=False, round_timeout=600.0)
    times = []
    for s in range(ROUNDS):
        step()
        t0 = time.perf_counter()
        sync.after_step(s)
        times.append(time.perf_counter() - t0)
    peak = vm_hwm() - base
    numel, shard = sync.numel, max(1, sync.shard.length)
    sync.close()
    if world > 1:
        dist.destroy_process_group()
    chunk = min(WRITE_CHUNK, numel) if world > 1 else 0  # the write's run (runtime/params.py)
    return {"copies_of_whole": peak / (4 * numel), "copies_of_shard": peak / (4 * shard),
            "copies_of_shard_and_chunk": peak / (4 * (shard + chunk)),
            "round_s": sum(times[1:]) / max(1, len(times) - 1)}


@dataclass
class _Result:  # the shape of relay.client.RoundResult the sync reads
    tensor: Any
    present: list[str]
    round_id: int
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


def run_cluster(size_m: int, world: int) -> list[RankFigures]:
    """N ranks, each its own process; their figures by rank."""
    with tempfile.TemporaryDirectory(prefix="nebula-outer-state-") as tmp:
        store = str(Path(tmp) / "store")
        env = {**os.environ, "NEBULA_SYNC_CONFIG": ""}
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--side", f"{r},{world},{size_m},{store}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for r in range(world)]
        try:
            outs = [p.communicate(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    figures = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        if p.returncode != 0:
            raise RuntimeError(f"rank {r} of {world} at {size_m} M failed: {err[-2000:]}")
        figures.append(RankFigures(size_m, world, r, **json.loads(out.strip().splitlines()[-1])))
    return figures


def summarize(runs: list[RankFigures]) -> dict[str, Any]:
    others = [f.copies_of_shard_and_chunk for f in runs if f.rank > 0] or [None]
    rank0 = [f.copies_of_whole for f in runs if f.rank == 0 and f.ranks > 1] or [None]
    worst = max((x for x in others if x is not None), default=None)
    return {"runs": [asdict(f) for f in runs],
            "max_rank_copies_of_shard": worst,
            "max_rank0_copies_of_whole": max((x for x in rank0 if x is not None), default=None),
            "goals_met": {"rank_copies_of_shard": None if worst is None
                          else worst <= GOAL_COPIES_OF_SHARD}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 M, 1 and 2 ranks")
    parser.add_argument("--sizes", default="20,40", help="model sizes in M parameters")
    parser.add_argument("--ranks", default="1,2,4", help="ranks per cluster")
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        rank, world, size_m, store = args.side.split(",", 3)
        print(json.dumps(rank_side(int(rank), int(world), int(size_m), store)))
        return 0
    sizes = [20] if args.quick else [int(x) for x in args.sizes.split(",")]
    ranks = [1, 2] if args.quick else [int(x) for x in args.ranks.split(",")]
    console = Console()
    console.print(f"outer state per rank: sizes {sizes} M, ranks {ranks}, {ROUNDS} rounds, "
                  f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    runs = [f for size in sizes for world in ranks for f in run_cluster(size, world)]
    table = Table("params", "ranks", "rank", "copies of the whole", "copies of its shard",
                  "of shard + chunk", "s per round")
    for f in runs:
        table.add_row(f"{f.size_m} M", str(f.ranks), str(f.rank), f"{f.copies_of_whole:.2f}",
                      f"{f.copies_of_shard:.2f}", f"{f.copies_of_shard_and_chunk:.2f}",
                      f"{f.round_s:.3f}")
    console.print(table)
    out = summarize(runs)
    console.print(f"other ranks: at most {out['max_rank_copies_of_shard']:.2f} copies of their "
                  f"shard and one chunk "
                  f"(goal {GOAL_COPIES_OF_SHARD}); rank 0: at most "
                  f"{out['max_rank0_copies_of_whole']:.2f} copies of the whole vector")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
