"""`nebula report`: a job's metrics as one self-contained HTML page and TensorBoard event files.

Both are optional extras (`pip install 'nebula-cli[report]'`: matplotlib, tensorboard); each
part says what it needs when it is missing. Drawn per cluster from the workers' records: train
and eval loss against step and against wall time, samples/s, the outer round's time and WAN
bytes per round; restarts (a ``resumed_from_step`` record) and rounds a cluster made alone
(``clusters_present`` below the job's clusters) are marked.
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


def by_cluster(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Worker records of rank 0 (the cluster's writer) per cluster, with ``t`` = seconds since
    the job's first record."""
    start = min((r["ts"] for r in records if isinstance(r.get("ts"), (int, float))), default=0)
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("role") == "worker" and r.get("rank") in (0, None) and "ts" in r:
            out[str(r.get("cluster"))].append({**r, "t": r["ts"] - start})
    return dict(sorted(out.items()))


def write_html(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """The report page, images embedded. ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = by_cluster(records)
    n_clusters = len(clusters)
    fig, axes = plt.subplots(3, 2, figsize=(12, 11))
    for ax, (name, xkey, ykey, kind) in zip(axes.flat, PANELS, strict=True):
        for cluster, recs in clusters.items():
            rows = [r for r in recs if isinstance(r.get(ykey), (int, float))
                    and (kind == "steps" or r.get("outer_round") is not None)]
            if not rows:
                continue
            line, = ax.plot([r[xkey] for r in rows], [r[ykey] for r in rows], marker=".",
                            label=cluster)
            alone = [r for r in rows if kind == "rounds"
                     and (r.get("clusters_present") or n_clusters) < n_clusters]
            if alone:
                ax.scatter([r[xkey] for r in alone], [r[ykey] for r in alone], marker="x",
                           s=60, color=line.get_color(), label=f"{cluster}: round alone")
            for r in recs:  # restarts
                if r.get("resumed_from_step") is not None and not r.get("final"):
                    ax.axvline(r[xkey] if xkey == "t" else r["resumed_from_step"],
                               color=line.get_color(), linestyle=":", linewidth=1)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=80)
    plt.close(fig)
    finals = [r for r in records if r.get("final") and r.get("role") == "worker"]
    rows = "".join(
        f"<tr><td>{html.escape(str(r.get('cluster')))}/{html.escape(str(r.get('host')))}"
        f"</td><td>{r.get('rank')}</td><td>{r.get('step')}</td>"
        f"<td>{html.escape(str(r.get('param_sha256', ''))[:16])}</td></tr>" for r in finals)
    path.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px}</style>"
        f"</head><body><h1>{html.escape(title)}</h1>"
        f"<p>{len(records)} records from {n_clusters} cluster(s). Dotted lines: restarts "
        "(at the step resumed from); crosses: rounds a cluster made without every peer.</p>"
        f"<img alt='metrics' src='data:image/png;base64,"
        f"{base64.b64encode(png.getvalue()).decode()}'>"
        "<h2>final parameters</h2><table><tr><th>worker</th><th>rank</th><th>step</th>"
        f"<th>sha256</th></tr>{rows}</table></body></html>")


def write_tensorboard(records: list[dict[str, Any]], directory: Path) -> int:
    """One run per cluster under `directory` (step, wall time kept); the scalars written.
    ImportError when tensorboard is missing."""
    import tensorboard  # noqa: F401 - SummaryWriter needs it; say so before torch does
    from torch.utils.tensorboard import SummaryWriter

    written = 0
    for cluster, recs in by_cluster(records).items():
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
