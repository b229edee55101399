"""The `nebula` command line: parse, call the orchestrator, render with ui. Nothing more."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from nebula_cli import __version__
from nebula_cli.errors import EXIT_FAILED, EXIT_OK, NebulaError, SpecError
from nebula_cli.live import print_line, watch
from nebula_cli.netbench import run_bench, write_report
from nebula_cli.netbench_render import bench_matrix, bench_progress
from nebula_cli.orchestrator import Orchestrator
from nebula_cli.spec import load_spec
from nebula_cli.state import END_STATES, StateStore
from nebula_cli.ui import (
    cluster_colors,
    host_checks_table,
    job_detail,
    jobs_table,
    spec_error_text,
    upload_bars,
)

app = typer.Typer(
    help="Train one model on several GPU clusters joined by slow wide-area links.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)
_debug = {"on": False}

F = TypeVar("F", bound=Callable[..., Any])
AcceptNew = Annotated[bool, typer.Option(
    "--accept-new-host-keys",
    help="Record host keys not yet in known_hosts (like OpenSSH's accept-new); a changed key "
         "is always refused.")]


def handle_errors(fn: F) -> F:
    """Turn nebula's errors into a message and an exit code; a traceback only with --debug."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SpecError as exc:
            if _debug["on"]:
                raise
            err.print(spec_error_text(exc))
            raise typer.Exit(exc.exit_code) from None
        except NebulaError as exc:
            if _debug["on"]:
                raise
            err.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
            raise typer.Exit(exc.exit_code) from None

    return wrapper  # type: ignore[return-value]


def version_callback(value: bool) -> None:
    if value:
        out.print(f"nebula {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=version_callback,
                                          is_eager=True, help="Print the version.")] = False,
) -> None:
    """nebula: one YAML job spec, several clusters, one model."""
    _debug["on"] = debug


def _store() -> StateStore:
    return StateStore()


@app.command()
@handle_errors
def validate(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="The job spec (YAML).")],
    hosts: Annotated[bool, typer.Option(
        "--hosts", help="Also reach every host: SSH, python, torch, deepspeed, disk.")] = False,
    accept_new: AcceptNew = False,
) -> None:
    """Check a job spec: every problem with file:line:col and the field path."""
    spec = load_spec(spec_path)
    n_hosts = sum(len(c.hosts) for c in spec.clusters)
    slots = sum(h.slots for c in spec.clusters for h in c.hosts)
    out.print(f"[green]✓[/] {spec_path} is valid: job [bold]{spec.name}[/], "
              f"{len(spec.clusters)} clusters, {n_hosts} hosts, {slots} processes")
    if not hosts:
        return
    with _store() as store, Orchestrator(store, accept_new_host_keys=accept_new) as orch:
        checks = orch.check_hosts(spec)
    out.print(host_checks_table(checks))
    bad = [c for c in checks if not c.ok]
    if bad:
        for c in bad:
            err.print(f"[bold red]{c.cluster}/{c.host}:[/] {'; '.join(c.problems)}",
                      markup=True)
        raise typer.Exit(EXIT_FAILED)
    out.print(f"[green]✓[/] all {len(checks)} hosts ready")


@app.command()
@handle_errors
def launch(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="The job spec (YAML).")],
    detach: Annotated[bool, typer.Option("--detach", "-d",
                                         help="Return once started; print the job id.")] = False,
    accept_new: AcceptNew = False,
) -> None:
    """Provision every host, start the job, then show it live (Ctrl-C detaches)."""
    spec = load_spec(spec_path)
    with _store() as store, Orchestrator(store, accept_new_host_keys=accept_new) as orch:
        with upload_bars(err) as (note, transfer):
            job = orch.launch(spec, progress=note, transfer=transfer)
        if detach:
            out.print(job.id)
            return
        out.print(f"[bold]{job.id}[/] running; Ctrl-C detaches (the job keeps running)")
        try:
            snap = watch(orch, job.id, out)
        except KeyboardInterrupt:
            out.print(f"\ndetached from [bold]{job.id}[/]; it keeps running.\n"
                      f"  follow:  nebula logs -f {job.id}\n"
                      f"  status:  nebula status {job.id}\n"
                      f"  stop:    nebula stop {job.id}")
            return
    raise typer.Exit(EXIT_OK if snap.job.state == "SUCCEEDED" else EXIT_FAILED)


@app.command()
@handle_errors
def status(
    job_ref: Annotated[str | None, typer.Argument(metavar="[JOB]", help="Job id, prefix or name.")]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON for scripts.")] = False,
) -> None:
    """All jobs, or one job per cluster and host."""
    with _store() as store, Orchestrator(store) as orch:
        if job_ref is None:
            jobs = []
            for job in store.list_jobs():
                if job.state not in END_STATES:
                    job = orch.refresh(job.id).job
                jobs.append(job)
            if as_json:
                out.print_json(json.dumps([_job_json(j) for j in jobs]))
            elif jobs:
                out.print(jobs_table(jobs))
            else:
                out.print("no jobs yet: start one with `nebula launch SPEC`")
            return
        snap = orch.refresh(job_ref)
        if as_json:
            hosts = [dataclasses.asdict(h) for h in snap.hosts]
            metrics = orch.follow_metrics(snap.job.id)
            metrics.poll()
            out.print_json(json.dumps({**_job_json(snap.job), "hosts": hosts,
                                       "metrics": metrics.latest, "relays": metrics.relay}))
            return
        metrics = orch.follow_metrics(snap.job.id)
        metrics.poll()
        out.print(job_detail(snap, metrics.latest))


def _job_json(job: Any) -> dict[str, Any]:
    d = dataclasses.asdict(job)
    d.pop("spec", None)
    d["clusters"] = job.clusters
    d["hosts"] = job.num_hosts
    return d


@app.command()
@handle_errors
def logs(
    job_ref: Annotated[str, typer.Argument(metavar="JOB", help="Job id, prefix or name.")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Follow until the job ends.")]
    = False,
    cluster: Annotated[str | None, typer.Option(help="Only this cluster.")] = None,
    host: Annotated[str | None, typer.Option(help="Only this host.")] = None,
    rank: Annotated[str | None, typer.Option(help="Only this rank (or 'relay').")] = None,
    tail: Annotated[int | None, typer.Option("--tail", "-n", help="Last N lines per process.")]
    = None,
) -> None:
    """The job's logs, each line prefixed cluster/host/rank."""
    with _store() as store, Orchestrator(store) as orch:
        job = store.get_job(job_ref)
        colors = cluster_colors(job.clusters)
        follower = orch.follow_logs(job.id, cluster=cluster, host=host, rank=rank, tail=tail)
        if not follower.tails:
            raise NebulaError("no logs match those filters")
        try:
            while True:
                snap = orch.refresh(job.id) if follow else None
                final = snap is None or not snap.active
                for line in follower.poll(final=final):
                    print_line(out, line, colors)
                if final:
                    break
                time.sleep(1.0)
        except KeyboardInterrupt:
            return


@app.command()
@handle_errors
def stop(
    job_ref: Annotated[str, typer.Argument(metavar="JOB", help="Job id, prefix or name.")],
    grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL.")] = 10.0,
    force: Annotated[bool, typer.Option("--force", help="Skip the grace period.")] = False,
) -> None:
    """Stop a job: SIGTERM every process group, wait the grace, SIGKILL. Nothing left running."""
    with _store() as store, Orchestrator(store) as orch:
        report = orch.stop(job_ref, grace=grace, force=force)
    if not report.stopped:
        out.print(f"{report.job.id} had already ended ({report.job.state.lower()}); "
                  "nothing was running")
        return
    for h in report.stopped:
        out.print(f"stopped {h.cluster}/{h.host} {h.role} (pid {h.pid or '-'})")
    extra = f", {report.swept} stray process(es) killed" if report.swept else ""
    out.print(f"[bold]{report.job.id}[/] {report.job.state.lower()}{extra}")


@app.command("bench-network")
@handle_errors
def bench_network(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="The job spec (YAML).")],
    duration: Annotated[float, typer.Option(
        help="Seconds each throughput test sends (TLS, then plain TCP).")] = 5.0,
    streams: Annotated[int, typer.Option(help="Parallel connections per throughput test.")]
    = 4,
    intra: Annotated[bool, typer.Option(
        "--intra", help="Also measure inside each cluster (its first two hosts).")] = False,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the figures as JSON here (read by `nebula plan`).")]
    = None,
    port: Annotated[int, typer.Option(
        help="Port of the TLS probe on SSH hosts (plain TCP: port+1); 0 picks free ones.")]
    = 0,
    accept_new: AcceptNew = False,
) -> None:
    """Latency and throughput between every pair of clusters, over the relay's TLS and plain TCP."""
    spec = load_spec(spec_path)
    with (_store() as store, Orchestrator(store, accept_new_host_keys=accept_new) as orch,
          bench_progress(err) as (note, step)):
        report = run_bench(orch, spec, duration=duration, streams=streams, intra=intra,
                           port=port, note=note, step=step)
    out.print(bench_matrix(report))
    if output is not None:
        write_report(report, output)
        out.print(f"figures written to {output}")
    for problem in report["errors"]:
        err.print(f"[bold red]error:[/] {problem}", markup=True, highlight=False)
    if report["errors"]:
        raise typer.Exit(EXIT_FAILED)


def run() -> None:  # pragma: no cover - console entry point wrapper
    sys.exit(app())
