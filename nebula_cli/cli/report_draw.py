"""`nebula report`'s drawing: a job's worker records as one figure (a PNG), the self-contained
HTML page around it, and TensorBoard runs made from the records.

matplotlib and tensorboard are the `report` extra (`pip install 'nebula-cli[report]'`); each
function raises ImportError when its library is missing. Drawn per cluster: train and eval
loss against step and against wall time, samples/s, the outer round's time and WAN bytes per
round; restarts (a ``resumed_from_step`` record) are dotted vertical lines at the step resumed
from (at the restart's time on the wall-time panel); rounds a cluster missed (a round whose
present ``clusters`` leave it out) are crosses in its colour where the others made them.
"""

from __future__ import annotations

import base64
import html
import io
from collections import defaultdict
from pathlib import Path
from typing import Any

EXTRA = "pip install 'nebula-cli[report]'"
SCALARS = ("loss", "eval_loss", "steps_per_s", "samples_per_s", "tokens_per_s", "lr",
           "round_s", "wan_bytes_sent", "wan_bytes_received", "delta_norm", "clusters_present")
PANELS = (  # (title, x key, y key, records: "rounds" or "steps")
    ("train loss by step", "step", "loss", "steps"),
    ("eval loss by step", "step", "eval_loss", "steps"),
    ("train loss by wall time (s)", "t", "loss", "steps"),
    ("samples/s", "step", "samples_per_s", "steps"),
    ("outer round time (s)", "step", "round_s", "rounds"),
    ("WAN bytes sent per round", "step", "wan_bytes_sent", "rounds"),
)
DPI = {"html": 80, "png": 100}
"""The figure's resolution in the page and as a PNG file of its own."""


def by_cluster(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Worker records of rank 0 (the cluster's writer) per cluster, with ``t`` = seconds since
    the job's first record."""
    start = min((r["ts"] for r in records if isinstance(r.get("ts"), (int, float))), default=0)
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("role") == "worker" and r.get("rank") in (0, None) and "ts" in r:
            out[str(r.get("cluster"))].append({**r, "t": r["ts"] - start})
    return dict(sorted(out.items()))


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


def figure_png(records: list[dict[str, Any]], dpi: int) -> bytes:
    """The figure of every panel, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = by_cluster(records)
    colors = {c: f"C{i % 10}" for i, c in enumerate(clusters)}
    lost = missed(clusters)
    fig, axes = plt.subplots(3, 2, figsize=(12, 11))
    for ax, (name, xkey, ykey, kind) in zip(axes.flat, PANELS, strict=True):
        for cluster, recs in clusters.items():
            color = colors[cluster]
            rows = [r for r in recs if isinstance(r.get(ykey), (int, float))
                    and (kind == "steps" or r.get("outer_round") is not None)]
            if rows:
                ax.plot([r[xkey] for r in rows], [r[ykey] for r in rows], marker=".",
                        color=color, label=cluster)
            gone = [r for r in lost[cluster] if isinstance(r.get(ykey), (int, float))]
            if kind == "rounds" and gone:  # where the others made the round without it
                ax.scatter([r[xkey] for r in gone], [r[ykey] for r in gone], marker="x",
                           s=60, color=color, label=f"{cluster}: missed round", zorder=3)
            for r in restarts(recs):
                ax.axvline(r[xkey] if xkey == "t" else r["resumed_from_step"],
                           color=color, linestyle=":", linewidth=1)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if ax.lines or ax.collections:
            ax.legend(fontsize="small")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi)
    plt.close(fig)
    return png.getvalue()


def html_page(records: list[dict[str, Any]], title: str) -> str:
    """The report page: the figure embedded, each cluster's restarts and missed rounds counted,
    and every worker's final parameters."""
    png = figure_png(records, DPI["html"])
    clusters = by_cluster(records)
    lost = missed(clusters)
    counts = "".join(
        f"<tr><td>{html.escape(c)}</td><td>{len(restarts(recs))}</td>"
        f"<td>{len(lost[c])}</td><td>{', '.join(str(r['outer_round']) for r in lost[c])}"
        "</td></tr>" for c, recs in clusters.items())
    finals = [r for r in records if r.get("final") and r.get("role") == "worker"]
    rows = "".join(
        f"<tr><td>{html.escape(str(r.get('cluster')))}/{html.escape(str(r.get('host')))}"
        f"</td><td>{r.get('rank')}</td><td>{r.get('step')}</td>"
        f"<td>{html.escape(str(r.get('param_sha256', ''))[:16])}</td></tr>" for r in finals)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px}</style>"
        f"</head><body><h1>{html.escape(title)}</h1>"
        f"<p>{len(records)} records from {len(clusters)} cluster(s). Dotted lines: restarts "
        "(at the step resumed from); crosses: rounds a cluster missed (where the others made "
        "them, in the colour of the cluster that missed them).</p>"
        f"<img alt='metrics' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        "<h2>per cluster</h2><table><tr><th>cluster</th><th>restarts</th>"
        f"<th>rounds missed</th><th>which</th></tr>{counts}</table>"
        "<h2>final parameters</h2><table><tr><th>worker</th><th>rank</th><th>step</th>"
        f"<th>sha256</th></tr>{rows}</table></body></html>")


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
