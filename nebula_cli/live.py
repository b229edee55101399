"""The live view of a running job: log lines above, a status panel below, until the job ends."""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live

from nebula_cli.orchestrator import JobSnapshot, Orchestrator
from nebula_cli.ui import cluster_colors, job_detail, log_text, status_panel

POLL_S = 0.5
REFRESH_S = 2.0


def watch(orch: Orchestrator, job_id: str, console: Console) -> JobSnapshot:
    """Stream logs and metrics of a job until every process has ended; the last snapshot.

    KeyboardInterrupt propagates (the caller detaches); the job keeps running."""
    snap = orch.refresh(job_id)
    colors = cluster_colors(snap.job.clusters)
    logs = orch.follow_logs(job_id)
    metrics = orch.follow_metrics(job_id)
    last = time.monotonic()
    with Live(status_panel(snap, {}, {}), console=console, refresh_per_second=4,
              transient=True, redirect_stdout=False) as live:
        while True:
            for line in logs.poll():
                live.console.print(log_text(line, colors), markup=False, highlight=False)
            metrics.poll()
            if time.monotonic() - last >= REFRESH_S:
                snap = orch.refresh(job_id)
                last = time.monotonic()
            live.update(status_panel(snap, metrics.latest, metrics.relay))
            if not snap.active:
                break
            time.sleep(POLL_S)
        for line in logs.poll(final=True):
            live.console.print(log_text(line, colors), markup=False, highlight=False)
        metrics.poll()
    console.print(status_panel(snap, metrics.latest, metrics.relay))
    console.print(job_detail(snap))
    return snap
