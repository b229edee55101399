"""rich renderables for the planner: a placement result, its search's progress bar, and the sync
advisor's predictions."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console, Group
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from nebula_cli.cli.fit import Column, FittedTable
from nebula_cli.planner.advisor import Advice, spec_lines
from nebula_cli.planner.outer_memory import ClusterMemory, gib
from nebula_cli.planner.placement import PhaseProgress, PlacementResult

PHASES = {"nebula": "nebula", "random": "random placements", "local_search": "local search"}


@contextmanager
def placement_progress(console: Console, time_limit: float | None) -> Iterator[PhaseProgress]:
    """A bar per search phase: evaluations of the budget, the best score so far, the time left
    (by the time limit, or by the evaluation rate). Hidden when the console is not a terminal."""
    progress = Progress(TextColumn("{task.description:<18}"), BarColumn(),
                        TextColumn("{task.completed:>6.0f}/{task.total:.0f} evaluations"),
                        TextColumn("best {task.fields[best]}"), TextColumn("{task.fields[left]}"),
                        TimeElapsedColumn(), console=console, transient=True,
                        disable=not console.is_terminal)
    tasks: dict[str, TaskID] = {}

    def update(phase: str, count: int, total: int, best: float, secs: float) -> None:
        if phase not in tasks:
            tasks[phase] = progress.add_task(PHASES.get(phase, phase), total=total,
                                             best="-", left="")
        by_rate = secs * (total - count) / count if count else None
        left = by_rate if time_limit is None else min(by_rate or time_limit,
                                                       max(0.0, time_limit - secs))
        progress.update(tasks[phase], completed=count, best=f"{best:.3f} s",
                        left="" if left is None else f"~{left:.0f} s left")

    with progress:
        yield update


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def placement_table(result: PlacementResult) -> Group:
    """Each pipeline (replica) as one row, its stages' devices in order (who sends to whom is
    read along a row, wrapped between devices, never inside one); each stage's costs; then the
    score, its parts, the baselines and the effort. Fits 80 columns at any replica count."""
    p = result.placement
    pipelines = Table(title="placement: each row is one pipeline, its stages in order",
                      title_justify="left")
    pipelines.add_column("replica", justify="right", no_wrap=True)
    pipelines.add_column(f"stage 0 -> {len(p.stages) - 1}" if p.stages else "stages",
                         overflow="fold")
    for r, devices in enumerate(p.replicas):
        pipelines.add_row(f"r{r}", " -> ".join(str(d) for d in devices))
    stages = Table(title="each stage's cost (s)", title_justify="left")
    for col in ("stage", "data s", "link to next s"):
        stages.add_column(col, justify="right", no_wrap=True)
    for j in range(len(p.stages)):
        link = p.links_s[j] if j < len(p.links_s) else None
        stages.add_row(str(j), _s(p.data_s[j]), _s(link))

    stop = (f", stopped at the {result.time_limit:g} s time limit" if result.timed_out
            else "")
    summary = Table(show_header=True, title=(
        f"score (s) = data + 2 x pipeline; lower bound {result.lower_bound:.3f} s, gap "
        f"{100 * result.gap:.1f} % (at most this share of the score is left to gain){stop}"),
        title_justify="left")
    for col in ("", "score", "data", "pipeline", "evaluations", "seconds"):
        summary.add_column(col, justify="right" if col else "left")
    summary.add_row(Text("nebula", style="bold"), Text(_s(p.cost.score), style="bold green"),
                    _s(p.cost.data), _s(p.cost.pipeline), str(result.evaluations),
                    f"{result.seconds:.1f}")
    names = {"random": "best of random placements", "local_search": "local search alone"}
    for key, label in names.items():
        score = result.baselines.get(key)
        if score is not None:
            secs = result.baseline_seconds.get(key)
            evals = result.baseline_evaluations.get(key)
            summary.add_row(label, _s(score), "", "", "-" if evals is None else str(evals),
                            "-" if secs is None else f"{secs:.1f}")
    return Group(pipelines, stages, summary)


def advisor_table(advice: Advice) -> Group:
    """Utilisation per H (rows) and codec (columns), the recommendation marked; then the spec
    lines to use."""
    mode = "with overlap" if advice.overlap else "without overlap"
    codecs = list(dict.fromkeys(p.codec for p in advice.predictions))
    table = Table(title=(f"utilisation {mode}: {advice.params:,} parameters, "
                         f"{advice.step_time_s:g} s/step, {advice.bandwidth_mbit:g} Mbit/s, "
                         f"rtt {advice.rtt_ms:g} ms, {advice.clusters} clusters"),
                  title_justify="left")
    table.add_column("H", justify="right")
    table.add_column("compute s", justify="right")
    for codec in codecs:
        wan = next(p.wan_s for p in advice.predictions if p.codec == codec)
        table.add_column(f"{codec}\n(WAN {wan:.2f} s)", justify="right")
    rec = advice.recommended
    for h in sorted({p.inner_steps for p in advice.predictions}):
        cells = []
        for codec in codecs:
            pred = next(p for p in advice.predictions if p.codec == codec and p.inner_steps == h)
            u = pred.utilisation(advice.overlap)
            style = "green" if u >= advice.target else "dim"
            if pred is rec:
                style = "bold reverse green" if advice.reached else "bold reverse yellow"
            cells.append(Text(f"{100 * u:.1f} %", style=style))
        table.add_row(str(h), f"{h * advice.step_time_s:.1f}", *cells)
    needed = ", ".join(f"{c} {'-' if h is None else h}" for c, h in advice.needed_h.items())
    verdict = (f"recommended: H = {rec.inner_steps}, codec {rec.codec} "
               f"({100 * rec.utilisation(advice.overlap):.1f} % utilisation)"
               if advice.reached else
               f"no H in the grid reaches {100 * advice.target:.0f} %; best: H = "
               f"{rec.inner_steps}, codec {rec.codec} "
               f"({100 * rec.utilisation(advice.overlap):.1f} %)")
    return Group(table, Text(verdict, style="bold"),
                 Text(f"smallest H reaching {100 * advice.target:.0f} %: {needed}",
                      style="dim"),
                 Text(spec_lines(advice).rstrip("\n")))


def outer_memory_table(params: int, clusters: list[ClusterMemory]) -> FittedTable:
    """Per cluster and process role, the memory the outer step takes (planner/outer_memory),
    fitted to the terminal (`cli.fit`: the total stays, the parts go first)."""
    table = FittedTable(
        [Column("cluster"), Column("process"), Column("ranks", keep=40, justify="right"),
         Column("shard", keep=50, justify="right"), Column("copies", keep=60, justify="right"),
         Column("own", keep=80, justify="right"), Column("shared", keep=70, justify="right"),
         Column("total", justify="right")],
        title=f"outer-step memory per process, GiB: {params:,} parameters (copies of the "
              "process's fp32 shard; shared: memfd, in no RSS)")
    for c in clusters:
        for p in c.processes:
            table.add_row(c.cluster, p.role.value, str(c.ranks), gib(p.shard_bytes, unit=False),
                          f"{p.copies:g}", gib(p.own_bytes, unit=False),
                          gib(p.shared_bytes, unit=False), gib(p.total_bytes, unit=False))
    return table
