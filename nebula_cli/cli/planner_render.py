"""rich renderables for the planner: a placement result, and the sync advisor's predictions."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from nebula_cli.planner.advisor import Advice, spec_lines
from nebula_cli.planner.placement import PlacementResult


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def placement_table(result: PlacementResult) -> Group:
    """Stages in pipeline order (one column per replica: who sends to whom is read along a
    column), then the score, its parts, the baselines and the effort."""
    p = result.placement
    stages = Table(title="placement (stage j of replica r; each column is one pipeline)",
                   title_justify="left")
    stages.add_column("stage", justify="right")
    for r in range(len(p.stages[0]) if p.stages else 0):
        stages.add_column(f"r{r}", overflow="fold")
    stages.add_column("data s", justify="right")
    stages.add_column("link to next s", justify="right")
    for j, devices in enumerate(p.stages):
        link = p.links_s[j] if j < len(p.links_s) else None
        stages.add_row(str(j), *[str(d) for d in devices], _s(p.data_s[j]), _s(link))

    summary = Table(show_header=True, title="score (s) = data + 2 x pipeline",
                    title_justify="left")
    for col in ("", "score", "data", "pipeline", "evaluations", "seconds"):
        summary.add_column(col, justify="right" if col else "left")
    summary.add_row(Text("nebula", style="bold"), Text(_s(p.cost.score), style="bold green"),
                    _s(p.cost.data), _s(p.cost.pipeline), str(result.evaluations),
                    f"{result.seconds:.1f}")
    names = {"random": "random partitions", "local_search": "local search alone"}
    for key, label in names.items():
        score = result.baselines.get(key)
        if score is not None:
            secs = result.baseline_seconds.get(key)
            summary.add_row(label, _s(score), "", "", str(result.budget),
                            "-" if secs is None else f"{secs:.1f}")
    return Group(stages, summary)


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
