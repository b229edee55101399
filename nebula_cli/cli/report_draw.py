"""`nebula report`'s drawing: a job's worker records as one figure (a PNG), the self-contained
HTML page around it, and TensorBoard runs made from the records.

matplotlib and tensorboard are the `report` extra (`pip install 'nebula-cli[report]'`); each
function raises ImportError when its library is missing.

What the live view shows per cluster is a panel or a column here: train and eval loss against
step, train loss against wall time, the throughput the job logged (tokens/s, samples/s or
steps/s, whichever its workers recorded, named on the axis), the outer round's time, WAN bytes
per round (sent and received, in human units on an absolute axis), the clusters present per
round; the page's tables add each cluster's newest step, loss, round and checkpoint, its
restarts and the rounds it missed. Every axis is labelled with its quantity and unit and has
no offset notation. A panel with nothing to draw is left out, and the page (or, for a PNG, the
command's output) says which and why.

Marks: restarts (a ``resumed_from_step`` record) are dotted vertical lines at the step resumed
from (at the restart's time on the wall-time panel); rounds a cluster missed (a round whose
present ``clusters`` leave it out) are crosses in its colour where the others made them, and
its line breaks there instead of joining the rounds on either side. Each cluster has the
colour it has in the live view (:mod:`nebula_cli.cli.palette`).
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from nebula_cli.cli.palette import cluster_colours
from nebula_cli.cli.ui import human_bytes
from nebula_cli.control import final_parameters

EXTRA = "pip install 'nebula-cli[report]'"
SCALARS = ("loss", "eval_loss", "steps_per_s", "samples_per_s", "tokens_per_s", "lr",
           "round_s", "wan_bytes_sent", "wan_bytes_received", "delta_norm", "clusters_present")
THROUGHPUTS = (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"),
               ("steps_per_s", "steps/s"))
"""What a job may log as its throughput, in the order the report prefers them."""
DPI = {"html": 80, "png": 100}
"""The figure's resolution in the page and as a PNG file of its own."""
PANEL_SIZE = (6.0, 3.6)
"""Inches per panel (two panels a row)."""
BYTE_UNITS = ("B", "KB", "MB", "GB", "TB")


class Kind(Enum):
    """Which records a panel draws: every step's, or the outer rounds' (rank 0's)."""

    STEPS = "steps"
    ROUNDS = "rounds"


@dataclass(frozen=True)
class Line:
    key: str
    """The record field drawn."""
    label: str = ""
    """Added to the cluster's name in the legend when a panel draws several lines."""
    style: str = "-"


@dataclass(frozen=True)
class Panel:
    title: str
    x: str
    """The record field on the x axis: ``step`` or ``t`` (seconds since the job's start)."""
    lines: tuple[Line, ...]
    kind: Kind
    ylabel: str
    bytes: bool = False
    """Values are bytes: drawn in the largest unit that keeps them readable."""
    from_zero: bool = False
    """The y axis starts at 0 (a rate, a time, a size: never a negative)."""
    integer: bool = False
    """Values are counts: whole-number ticks."""

    @property
    def xlabel(self) -> str:
        return "wall time since the job's start (s)" if self.x == "t" else "step"


@dataclass(frozen=True)
class Omitted:
    """A panel left out, and why."""

    title: str
    reason: str


def by_cluster(records: list[dict[str, Any]], order: Sequence[str] = ()
               ) -> dict[str, list[dict[str, Any]]]:
    """Worker records of rank 0 (the cluster's writer) per cluster, with ``t`` = seconds since
    the job's first record; clusters in `order` (the job's) first, then any other by name."""
    start = min((r["ts"] for r in records if isinstance(r.get("ts"), (int, float))), default=0)
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("role") == "worker" and r.get("rank") in (0, None) and "ts" in r:
            out[str(r.get("cluster"))].append({**r, "t": r["ts"] - start})
    names = [c for c in order if c in out] + sorted(c for c in out if c not in order)
    return {c: out[c] for c in names}


def page_colours(order: Sequence[str], clusters: Iterable[str]) -> dict[str, str]:
    """Each cluster's colour on the page: the live view's, by the job's order."""
    names = dict.fromkeys([*order, *clusters])
    return {c: col.page for c, col in cluster_colours(names).items()}


def restarts(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A cluster's restarts: the records that say a worker resumed from a checkpoint."""
    return [r for r in recs if r.get("resumed_from_step") is not None and not r.get("final")]


def missed(clusters: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """cluster -> the rounds it missed: for each round, the first record of a cluster that made
    it whose ``clusters`` (the names present; rank 0's records have them) leaves it out."""
    seen: dict[int, dict[str, Any]] = {}
    for recs in clusters.values():
        for r in recs:
            if isinstance(r.get("clusters"), list) and r.get("outer_round") is not None:
                seen.setdefault(r["outer_round"], r)
    return {c: [r for _, r in sorted(seen.items()) if c not in r["clusters"]]
            for c in clusters}


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def throughput(records: Iterable[dict[str, Any]]) -> tuple[str, str] | None:
    """(field, unit) of the throughput the job logged: tokens/s if any worker recorded it,
    else samples/s, else steps/s; None when it logged none."""
    logged = {key for r in records for key, _ in THROUGHPUTS if _number(r.get(key))}
    return next(((key, unit) for key, unit in THROUGHPUTS if key in logged), None)


def panels(records: list[dict[str, Any]]) -> tuple[list[Panel], list[Omitted]]:
    """The panels this job's records fill, and those left out with the reason."""
    rate = throughput(records)
    wanted = [
        Panel("train loss by step", "step", (Line("loss"),), Kind.STEPS, "train loss"),
        Panel("eval loss by step", "step", (Line("eval_loss"),), Kind.STEPS, "eval loss"),
        Panel("train loss by wall time", "t", (Line("loss"),), Kind.STEPS, "train loss"),
        Panel(f"throughput ({rate[1]})" if rate else "throughput", "step",
              (Line(rate[0]),) if rate else (), Kind.STEPS, rate[1] if rate else "",
              from_zero=True),
        Panel("outer round time", "step", (Line("round_s"),), Kind.ROUNDS,
              "seconds per round", from_zero=True),
        Panel("WAN traffic per round", "step",
              (Line("wan_bytes_sent", "sent"), Line("wan_bytes_received", "received", "--")),
              Kind.ROUNDS, "per round", bytes=True, from_zero=True),
        Panel("clusters present per round", "step", (Line("clusters_present"),), Kind.ROUNDS,
              "clusters", from_zero=True, integer=True),
    ]
    workers = [r for r in records if r.get("role") == "worker"]
    kept, omitted = [], []
    for p in wanted:
        if not p.lines:
            omitted.append(Omitted(p.title, "the workers logged no tokens_per_s, samples_per_s "
                                            "or steps_per_s"))
        elif not any(_number(r.get(line.key)) for r in workers for line in p.lines):
            keys = " or ".join(line.key for line in p.lines)
            why = (f"no round recorded {keys} (a job of one cluster, or no outer round yet)"
                   if p.kind is Kind.ROUNDS else f"the workers logged no {keys}")
            omitted.append(Omitted(p.title, why))
        else:
            kept.append(p)
    return kept, omitted


def _byte_scale(values: Iterable[float]) -> tuple[float, str]:
    """(divisor, unit) that shows the largest of `values` as a number under 1000."""
    top = max((abs(v) for v in values), default=0.0)
    for i, unit in enumerate(BYTE_UNITS):
        if top < 1000 ** (i + 1) or unit == BYTE_UNITS[-1]:
            return float(1000 ** i), unit
    return 1.0, "B"  # pragma: no cover - the loop always returns


def _rows(recs: list[dict[str, Any]], panel: Panel, key: str) -> list[dict[str, Any]]:
    return [r for r in recs if _number(r.get(key)) and _number(r.get(panel.x))
            and (panel.kind is Kind.STEPS or r.get("outer_round") is not None)]


def _broken(rows: list[dict[str, Any]], panel: Panel, key: str, scale: float
            ) -> tuple[list[float], list[float]]:
    """x and y of a line, with a gap (NaN) wherever the cluster skipped an outer round, so
    that the line does not join the rounds on either side of one it missed."""
    xs: list[float] = []
    ys: list[float] = []
    prev: int | None = None
    for r in rows:
        rnd = r.get("outer_round") if panel.kind is Kind.ROUNDS else None
        if isinstance(rnd, int) and prev is not None and rnd > prev + 1:
            xs.append(math.nan)
            ys.append(math.nan)
        if isinstance(rnd, int):
            prev = rnd
        xs.append(r[panel.x])
        ys.append(r[key] / scale)
    return xs, ys


@dataclass
class Drawing:
    """The figure and what it left out (for the page's table or the command's output)."""

    figure: Any
    """A matplotlib Figure (close it with matplotlib.pyplot.close once written)."""
    panels: list[Panel]
    omitted: list[Omitted]


def draw(records: list[dict[str, Any]], order: Sequence[str] = ()) -> Drawing:
    """The figure of every panel the records fill, clusters in the job's `order` and colours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    clusters = by_cluster(records, order)
    colours = page_colours(order, clusters)
    lost = missed(clusters)
    kept, omitted = panels(records)
    rows_n = max(1, math.ceil(len(kept) / 2))
    fig, axes = plt.subplots(rows_n, 2, figsize=(2 * PANEL_SIZE[0], rows_n * PANEL_SIZE[1]),
                             squeeze=False)
    spare = list(axes.flat)[len(kept):]
    for ax in spare:  # an odd number of panels: no empty frame
        fig.delaxes(ax)
    for ax, panel in zip(axes.flat, kept, strict=False):
        scale, unit = 1.0, ""
        if panel.bytes:
            scale, unit = _byte_scale(r[line.key] for recs in clusters.values()
                                      for line in panel.lines for r in _rows(recs, panel,
                                                                            line.key))
        for cluster, recs in clusters.items():
            colour = colours[cluster]
            for line in panel.lines:
                rows = _rows(recs, panel, line.key)
                if rows:
                    xs, ys = _broken(rows, panel, line.key, scale)
                    label = f"{cluster} {line.label}".strip()
                    ax.plot(xs, ys, marker=".", linestyle=line.style, color=colour,
                            label=label)
                gone = [r for r in lost[cluster] if _number(r.get(line.key))]
                if panel.kind is Kind.ROUNDS and gone:  # where the others made it without it
                    ax.scatter([r[panel.x] for r in gone], [r[line.key] / scale for r in gone],
                               marker="x", s=60, color=colour, zorder=3,
                               label=f"{cluster}: missed round" if line is panel.lines[0]
                               else None)
            for r in restarts(recs):
                ax.axvline(r[panel.x] if panel.x == "t" else r["resumed_from_step"],
                           color=colour, linestyle=":", linewidth=1)
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(f"{unit} {panel.ylabel}".strip())
        ax.ticklabel_format(axis="both", style="plain", useOffset=False)
        if panel.from_zero:  # from 0, with room above the highest point
            top = max((y for line in ax.lines for y in line.get_ydata() if _number(y)),
                      default=0.0)
            ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)
        if panel.integer:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    return Drawing(fig, kept, omitted)


def figure_png(records: list[dict[str, Any]], dpi: int, order: Sequence[str] = ()
               ) -> tuple[bytes, list[Omitted]]:
    """The figure as PNG bytes, and the panels it left out."""
    import matplotlib.pyplot as plt

    drawing = draw(records, order)
    png = io.BytesIO()
    try:
        drawing.figure.savefig(png, format="png", dpi=dpi)
    finally:
        plt.close(drawing.figure)
    return png.getvalue(), drawing.omitted


def _cell(v: object, fmt: str = "") -> str:
    if v is None:
        return "-"
    if _number(v) and fmt:
        return format(v, fmt)
    return _text(v)


def _text(v: object) -> str:
    """A value a host sent, as text on the page (whatever markup it holds)."""
    return html.escape(str(v))


def _numbers(recs: list[dict[str, Any]], key: str) -> list[float]:
    """Every number the records hold under ``key``, in order."""
    return [r[key] for r in recs if _number(r.get(key))]


def _latest(recs: list[dict[str, Any]], key: str) -> Any:
    return next((r[key] for r in reversed(recs) if r.get(key) is not None), None)


def _first(recs: list[dict[str, Any]], key: str) -> Any:
    return next((r[key] for r in recs if r.get(key) is not None), None)


def wan_totals(records: list[dict[str, Any]], cluster: str) -> tuple[float | None, float | None]:
    """(sent, received) bytes over the WAN by a cluster so far, as the live view shows them:
    its relay's running totals, else the sum of its workers' per-round figures."""
    relay = [r for r in records if r.get("role") == "relay" and r.get("cluster") == cluster
             and _number(r.get("bytes_sent_total"))]
    if relay:
        last = relay[-1]
        return last["bytes_sent_total"], last.get("bytes_received_total")
    rounds = [r for r in by_cluster(records).get(cluster, []) if r.get("outer_round") is not None]
    sums = tuple(sum(r[k] for r in rounds if _number(r.get(k))) if any(
        _number(r.get(k)) for r in rounds) else None for k in ("wan_bytes_sent",
                                                                "wan_bytes_received"))
    return sums[0], sums[1]


def soft_labels_table(clusters: dict[str, list[dict[str, Any]]]) -> str:
    """A student cluster's soft labels at the end (its loader's newest record: batches trained
    with labels of all, bytes per token, time waited; the KD term of its first and its last
    interval), as `nebula status` shows them, and a
    teacher cluster's answers (`teacher_table`); "" for a job without distillation."""
    rows = "".join(
        f"<tr><td>{html.escape(c)}</td><td>{_cell(_latest(recs, 'distill_batches'))}</td>"
        f"<td>{_cell(_latest(recs, 'distill_without_labels'))}</td>"
        f"<td>{_cell(_latest(recs, 'distill_bytes_per_token'), '.1f')}</td>"
        f"<td>{_cell(_latest(recs, 'distill_wait_s'), '.2f')}</td>"
        f"<td>{_cell(_latest(recs, 'distill_longest_wait_s'), '.2f')}</td>"
        f"<td>{_cell(_first(recs, 'distill_kd'), '.4f')}</td>"
        f"<td>{_cell(_latest(recs, 'distill_kd'), '.4f')}</td></tr>"
        for c, recs in clusters.items() if _latest(recs, "distill_batches") is not None)
    students = ("<h2>soft labels (distillation)</h2><table><tr><th>cluster</th><th>batches</th>"
                "<th>without labels</th><th>bytes per token</th><th>waited (s)</th>"
                "<th>longest wait (s)</th><th>KD, first</th><th>KD, last</th></tr>"
                f"{rows}</table>") if rows else ""
    return students + teacher_table(clusters)


def teacher_table(clusters: dict[str, list[dict[str, Any]]]) -> str:
    """A teacher cluster's answers over the run (from its label relay's records): answers and
    tokens in all, answers per second over the run and at their busiest, mean and worst latency
    of the records' intervals, the longest queue; "" without a teacher cluster."""
    rows = []
    for c, recs in clusters.items():
        mine = [r for r in recs if _number(r.get("teacher_answers")) and _number(r.get("ts"))]
        if not mine:
            continue
        first, last = mine[0], mine[-1]
        span = last["ts"] - first["ts"]
        overall = (last["teacher_answers"] - first["teacher_answers"]) / span if span > 0 \
            else None
        lat = _numbers(mine, "teacher_latency_ms")
        rows.append(
            f"<tr><td>{html.escape(c)}</td><td>{_cell(last['teacher_answers'])}</td>"
            f"<td>{_cell(_latest(mine, 'teacher_tokens'))}</td><td>{_cell(overall, '.2f')}</td>"
            f"<td>{_cell(max(_numbers(mine, 'teacher_answers_per_s'), default=None), '.2f')}</td>"
            f"<td>{_cell(sum(lat) / len(lat) if lat else None, '.1f')}</td>"
            f"<td>{_cell(max(lat, default=None), '.1f')}</td>"
            f"<td>{_cell(max(_numbers(mine, 'teacher_queue'), default=None))}</td></tr>")
    return ("<h2>teacher (distillation)</h2><table><tr><th>cluster</th><th>answers</th>"
            "<th>tokens</th><th>answers/s</th><th>busiest answers/s</th>"
            "<th>latency (ms)</th><th>worst latency (ms)</th><th>longest queue</th></tr>"
            f"{''.join(rows)}</table>") if rows else ""


def html_page(records: list[dict[str, Any]], title: str, order: Sequence[str] = (),
              said: final_parameters.ParameterVerdict | None = None) -> str:
    """The report page: the figure embedded, the panels left out and why, what the live view
    shows of each cluster at the end (with distillation, its soft labels), its restarts and
    missed rounds, and every worker's final parameters with whether they agree (``said``:
    `control.final_parameters.of_job`'s verdict)."""
    png, omitted = figure_png(records, DPI["html"], order)
    clusters = by_cluster(records, order)
    colours = page_colours(order, clusters)
    lost = missed(clusters)
    rate = throughput(records)
    counts = "".join(
        f"<tr><td>{html.escape(c)}</td><td>{len(restarts(recs))}</td>"
        f"<td>{len(lost[c])}</td><td>{', '.join(_text(r['outer_round']) for r in lost[c])}"
        "</td></tr>" for c, recs in clusters.items())
    latest = "".join(
        f"<tr><td style='color:{colours[c]}'>{html.escape(c)}</td>"
        f"<td>{_cell(_latest(recs, 'step'))}</td><td>{_cell(_latest(recs, 'loss'), '.4f')}</td>"
        f"<td>{_cell(_latest(recs, 'eval_loss'), '.4f')}</td>"
        f"<td>{_cell(_latest(recs, rate[0]) if rate else None, '.1f')}</td>"
        f"<td>{_cell(_latest(recs, 'outer_round'))}</td>"
        f"<td>{_cell(_latest(recs, 'round_s'), '.2f')}</td>"
        f"<td>{_cell(_latest(recs, 'clusters_present'))}</td>"
        f"<td>{_cell(_latest(recs, 'checkpoint_step'))}</td>"
        + "".join(f"<td>{human_bytes(v)}</td>" for v in wan_totals(records, c)) + "</tr>"
        for c, recs in clusters.items())
    left = "".join(f"<tr><td>{html.escape(o.title)}</td><td>{html.escape(o.reason)}</td></tr>"
                   for o in omitted)
    left_out = ("<h2>panels left out</h2><table><tr><th>panel</th><th>why</th></tr>"
                f"{left}</table>") if omitted else ""
    finals = [r for r in records if r.get("final") and r.get("role") == "worker"]
    said_html = "" if said is None else html.escape(said.sentence())
    verdict = "" if said is None else (
        f"<p style='color:green'>{said_html} (each worker's last final record)</p>"
        if said.identical else
        f"<p style='color:red'><b>{said_html}</b> (each worker's last final record)</p>")
    rows = "".join(
        f"<tr><td>{_text(r.get('cluster'))}/{_text(r.get('host'))}"
        f"</td><td>{_text(r.get('rank'))}</td><td>{_text(r.get('step'))}</td>"
        f"<td>{_text(str(r.get('param_sha256', ''))[:16])}</td></tr>" for r in finals)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px}</style>"
        f"</head><body><h1>{html.escape(title)}</h1>"
        f"<p>{len(records)} records from {len(clusters)} cluster(s). Dotted lines: restarts "
        "(at the step resumed from); crosses: rounds a cluster missed (where the others made "
        "them, in the colour of the cluster that missed them; its line breaks there).</p>"
        f"<img alt='metrics' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        f"{left_out}"
        "<h2>at the end</h2><table><tr><th>cluster</th><th>step</th><th>loss</th>"
        f"<th>eval loss</th><th>{html.escape(rate[1] if rate else 'throughput')}</th>"
        "<th>round</th><th>round time (s)</th><th>present</th><th>checkpoint</th>"
        "<th>WAN sent</th><th>WAN received</th></tr>"
        f"{latest}</table>{soft_labels_table(clusters)}"
        "<h2>per cluster</h2><table><tr><th>cluster</th><th>restarts</th>"
        f"<th>rounds missed</th><th>which</th></tr>{counts}</table>"
        "<h2>final parameters</h2><table><tr><th>worker</th><th>rank</th><th>step</th>"
        f"<th>sha256</th></tr>{rows}</table>{verdict}</body></html>")


def write_tensorboard(records: list[dict[str, Any]], directory: Path) -> int:
    """One run per cluster under `directory` (step, wall time kept), replacing the one an
    earlier report made; the scalars written."""
    import tensorboard  # noqa: F401 - SummaryWriter needs it; say so before torch does
    from torch.utils.tensorboard import SummaryWriter

    written = 0
    for cluster, recs in by_cluster(records).items():
        for old in (directory / cluster).glob("events.out.tfevents.*"):  # an earlier report's
            old.unlink()
        writer = SummaryWriter(log_dir=str(directory / cluster))
        try:
            for r in recs:
                for key in SCALARS:
                    value = r.get(key)
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        writer.add_scalar(key, value, global_step=int(r.get("step") or 0),
                                          walltime=float(r["ts"]))
                        written += 1
        finally:
            writer.close()
    return written
