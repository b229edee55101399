"""The live view of a running job: log lines above, a status panel below, until the job ends.

Its memory does not grow with the run: the metrics follower keeps a bounded history."""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.text import Text

from nebula_cli.cli.ui import cluster_colors, final_summary, job_detail, log_text, status_panel
from nebula_cli.control import final_parameters
from nebula_cli.control.follow import LogLine
from nebula_cli.control.jobs import JobOps, JobSnapshot
from nebula_cli.runtime.metrics import METRICS_TAG

POLL_S = 0.5
REFRESH_S = 2.0


def watch(jobs: JobOps, job_id: str, console: Console) -> JobSnapshot:
    """Stream logs and metrics of a job until every process has ended; the last snapshot.

    KeyboardInterrupt propagates (the caller detaches); the job keeps running."""
    snap = jobs.refresh(job_id)
    colors = cluster_colors(snap.job.clusters)
    logs = jobs.follow_logs(job_id)
    metrics = jobs.follow_metrics(job_id)
    last = time.monotonic()
    with Live(status_panel(snap, {}, {}), console=console, refresh_per_second=4,
              transient=True, redirect_stdout=False) as live:
        while True:
            for line in shown(logs.poll()):
                print_line(live.console, line, colors)
            metrics.poll()
            for problem in logs.reach.take() + metrics.reach.take():
                live.console.print(Text(f"warning: {problem}", style="yellow"))
            if time.monotonic() - last >= REFRESH_S:
                snap = jobs.refresh(job_id)
                last = time.monotonic()
            live.update(status_panel(snap, metrics.latest, metrics.relay, metrics.history))
            if not snap.active:
                break
            time.sleep(POLL_S)
        for line in shown(logs.poll(final=True)):
            print_line(live.console, line, colors)
        metrics.poll()
    console.print(status_panel(snap, metrics.latest, metrics.relay, metrics.history))
    console.print(job_detail(snap))
    summary = final_summary(metrics.finals, snap.job.clusters,
                            final_parameters.of_job(snap.job, metrics.finals))
    if summary is not None:
        console.print(summary)
    return snap


def print_line(console: Console, line: LogLine, colors: dict[str, str]) -> None:
    console.print(log_text(line, colors), markup=False, highlight=False, soft_wrap=True)


def shown(lines: list[LogLine]) -> list[LogLine]:
    """Log lines for the live view: metric records are shown in the panel instead."""
    return [ln for ln in lines if METRICS_TAG not in ln.text]
