"""The `nebula` command line: parse, call the orchestrator, render with ui. Nothing more."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from nebula_cli import __version__, pki
from nebula_cli.cli.live import print_line, watch
from nebula_cli.cli.netbench_render import bench_matrix, bench_progress
from nebula_cli.cli.planner_render import (
    advisor_table,
    outer_memory_table,
    placement_progress,
    placement_table,
)
from nebula_cli.cli.reach_render import reach_problems, reach_table
from nebula_cli.cli.report import copy_tensorboard, make_report
from nebula_cli.cli.ui import (
    cluster_colors,
    host_checks_table,
    job_detail,
    jobs_table,
    spec_error_text,
    spec_summary,
    upload_bars,
)
from nebula_cli.config.spec import JobSpec, load_spec
from nebula_cli.control import final_parameters, teacher_source
from nebula_cli.control.dryrun import measure
from nebula_cli.control.memory_fit import memory_problems
from nebula_cli.control.netbench import run_bench, write_report
from nebula_cli.control.orchestrator import Orchestrator
from nebula_cli.control.reachcheck import check_reach
from nebula_cli.control.state import END_STATES, StateStore
from nebula_cli.control.teacher_model import TeacherModel, model_problems, teacher_models
from nebula_cli.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    LaunchError,
    NebulaError,
    SpecError,
    UsageError,
)
from nebula_cli.planner import (
    CostModel,
    Task,
    advise,
    devices_from_spec,
    load_devices,
    load_netbench,
    plan_placement,
    wan_link,
)
from nebula_cli.planner.outer_memory import ClusterMemory, job_memory
from nebula_cli.templates import DEFAULT_TEMPLATE, template_names, template_text

app = typer.Typer(
    help="Train one model on several GPU clusters joined by slow wide-area links.",
    no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstrings' single line breaks reflow at any width
)
JOB_HELP = ("Job id, a unique prefix of one, a job name (its newest job), or a short id (the id's "
            "last four hex digits, alone or after the name: 954f, hello-954f).")
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


def _source_problems(spec: JobSpec) -> tuple[list[str], list[str]]:
    """`teacher_source.source_problems`, the local records opened only for a spec with a
    `teacher: {from_job:}`."""
    if not teacher_source.sourced_teachers(spec):
        return [], []
    with _store() as store:
        return teacher_source.source_problems(store, spec)


@app.command()
@handle_errors
def validate(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="The job spec (YAML).")],
    hosts: Annotated[bool, typer.Option(
        "--hosts", help="Also reach every host: SSH, python, torch, deepspeed, disk, memory.")]
        = False,
    params: Annotated[int | None, typer.Option(
        "--params", min=1, help="Trainable parameters: print each process's outer-step memory; "
        "with --hosts, refuse hosts that cannot hold it.")] = None,
    accept_new: AcceptNew = False,
) -> None:
    """Check a job spec: every problem with file:line:col and the field path."""
    spec = load_spec(spec_path)
    out.print(spec_summary(spec_path, spec))
    if params is not None:
        out.print(outer_memory_table(params, _job_memory(spec, params)))
    sourced, said = _source_problems(spec)
    for note in said:
        _note(note)
    if not hosts:
        models = teacher_models(spec)
        bad, notes = model_problems(spec, models)
        bad += sourced
        _say_models(models, notes)
        for problem in bad:
            err.print(f"[bold red]error:[/] {escape(problem)}", markup=True)
        if bad:
            raise typer.Exit(EXIT_FAILED)
        return
    found: list[str] = []
    with _store() as store, Orchestrator(store, accept_new_host_keys=accept_new) as orch:
        checks = orch.check_hosts(spec)
        ready = all(c.ok for c in checks)
        reach = check_reach(orch.facts, spec) if ready and spec.links() else None
        models = teacher_models(spec, orch.read_on_gateway if ready else None)
        if not sourced:
            found, sourced = teacher_source.find_sources(store, orch.session.transport, spec)
    out.print(host_checks_table(checks))
    for c in checks:
        if c.reached:
            out.print(f"[dim]{escape(c.cluster)}/{escape(c.host)}: {escape(c.reached)}[/]")
    bad = [f"{c.cluster}/{c.host}: {'; '.join(c.problems)}" for c in checks if not c.ok]
    problems, notes = model_problems(spec, models)
    _say_models(models, notes)
    for line in found if not sourced else []:
        out.print(f"[dim]{escape(line)}[/]")
    bad += problems + sourced
    if params is not None:
        bad += memory_problems(spec, checks, params)
    if reach is not None:
        out.print(reach_table(reach), *(f"[dim]{note}[/]" for note in reach.notes))
        bad += reach_problems(reach)
    for problem in bad:
        err.print(f"[bold red]error:[/] {problem}", markup=True)
    if bad:
        raise typer.Exit(EXIT_FAILED)
    out.print(f"[green]✓[/] all {len(checks)} hosts ready"
              + (", every pair of relays can connect" if reach is not None else ""))


def _say_models(models: list[TeacherModel], notes: list[str]) -> None:
    """What validate read of each teacher's model (or why not), and its notes."""
    for m in models:
        if m.missing is None:
            out.print(f"[dim]{escape(m.said())}[/]")
    for note in notes:
        _note(note)


def _note(text: str) -> None:
    err.print(f"[yellow]note:[/] {escape(text)}", markup=True, highlight=False)


@app.command()
@handle_errors
def init(
    spec_path: Annotated[Path, typer.Argument(
        metavar="[SPEC]", help="Where to write the starter spec.")] = Path("job.yaml"),
    template: Annotated[str, typer.Option(
        "--template", "-t",
        help=f"Which starter: {', '.join(template_names())} (a local one runs as it is).")]
        = DEFAULT_TEMPLATE,
    force: Annotated[bool, typer.Option("--force", help="Overwrite SPEC if it exists.")] = False,
) -> None:
    """Write a commented starter job spec to edit (two clusters; `validate` checks it)."""
    text = template_text(template)
    taken = (f"{spec_path} exists; pass --force to overwrite it, or name another file: "
             "`nebula init other.yaml`")
    if os.path.lexists(spec_path) and not force:  # a dangling symlink too
        raise UsageError(taken)
    if force and (spec_path.is_symlink() or spec_path.is_file()):
        spec_path.unlink()  # the link itself, never what it points to
    try:  # 0600 whatever the umask (a spec may hold secrets in `env`), never through a link
        fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError as exc:
        raise UsageError(taken) from exc
    with os.fdopen(fd, "w") as f:
        f.write(text)
    out.print(f"wrote {spec_path} (starter: {template}); edit it, then "
              f"`nebula validate {spec_path} --hosts`")


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
    bad, notes = model_problems(spec, teacher_models(spec))  # before any host is touched
    sourced, _ = _source_problems(spec)
    for note in [*(spec.distill.notes() if spec.distill is not None else []), *notes]:
        _note(note)
    if bad or sourced:
        raise LaunchError("\n".join(bad + sourced))
    with _store() as store, Orchestrator(store, accept_new_host_keys=accept_new) as orch:
        _bring_up(orch, lambda note, transfer: orch.launch(spec, progress=note,
                                                           transfer=transfer), detach, "launch")


@app.command()
@handle_errors
def resume(
    job_ref: Annotated[str, typer.Argument(metavar="JOB", help=JOB_HELP)],
    detach: Annotated[bool, typer.Option("--detach", "-d",
                                         help="Return once started; print the job id.")] = False,
    accept_new: AcceptNew = False,
) -> None:
    """Continue a stopped, failed or cancelled job (same id; a new CA and certificates, so
    those of earlier attempts are refused):
    every worker starts from its newest complete checkpoint."""
    with _store() as store, Orchestrator(store, accept_new_host_keys=accept_new) as orch:
        _bring_up(orch, lambda note, transfer: orch.resume(job_ref, progress=note,
                                                           transfer=transfer), detach, "resume")


def _bring_up(orch: Orchestrator, start: Callable[[Any, Any], Any], detach: bool,
              action: str) -> None:
    """Run a launch or resume with upload bars, then print the job id (--detach) or show it
    live until it ends (Ctrl-C detaches)."""
    try:
        with upload_bars(err) as (note, transfer):
            job = start(note, transfer)
    except KeyboardInterrupt:
        err.print(f"\n{action} cancelled; everything it had started was ended")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if detach:
        out.print(job.id)
        return
    out.print(f"[bold]{job.id}[/] running; Ctrl-C detaches (the job keeps running)")
    try:
        snap = watch(orch.jobs, job.id, out)
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
    job_ref: Annotated[str | None, typer.Argument(metavar="[JOB]", help=JOB_HELP)]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON for scripts.")] = False,
) -> None:
    """All jobs, or one job per cluster and host."""
    with _store() as store, Orchestrator(store) as orch:
        if job_ref is None:
            jobs = []
            for job in store.list_jobs():
                if job.state not in END_STATES:
                    job = orch.jobs.refresh(job.id).job
                jobs.append(job)
            if as_json:
                out.print_json(json.dumps([_job_json(j, orch.attempt(j.id)) for j in jobs]))
            elif jobs:
                out.print(jobs_table(jobs))
            else:
                out.print("no jobs yet: start one with `nebula launch SPEC`")
            return
        snap = orch.jobs.refresh(job_ref)
        expiring = pki.expiry_warning(store.job_dir(snap.job.id) / "pki")  # a week before
        if expiring and snap.job.state not in END_STATES:
            err.print(f"[bold yellow]warning:[/] {expiring}", markup=True, highlight=False)
        view = orch.jobs.metrics_view(snap)  # the agents' summaries: no metrics file is re-read
        if as_json:
            hosts = [dataclasses.asdict(h) for h in snap.hosts]
            said = final_parameters.of_job(snap.job, view.finals)
            out.print_json(json.dumps({**_job_json(snap.job, orch.attempt(snap.job.id)),
                                       "hosts": hosts,
                                       "metrics": view.latest, "relays": view.relay,
                                       "final_parameters": said and said.to_json()}))
            return
        out.print(job_detail(snap, view.latest, view.relay, orch.attempt(snap.job.id),
                             view.finals))


def _job_json(job: Any, attempt: int) -> dict[str, Any]:
    d = dataclasses.asdict(job)
    d.pop("spec", None)
    d["clusters"] = job.clusters
    d["hosts"] = job.num_hosts
    d["attempt"] = attempt
    return d


@app.command()
@handle_errors
def logs(
    job_ref: Annotated[str, typer.Argument(metavar="JOB", help=JOB_HELP)],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Follow until the job ends.")]
    = False,
    cluster: Annotated[str | None, typer.Option(help="Only this cluster.")] = None,
    host: Annotated[str | None, typer.Option(help="Only this host.")] = None,
    rank: Annotated[str | None, typer.Option(help="Only this rank (or 'relay').")] = None,
    tail: Annotated[int | None, typer.Option("--tail", "-n", help="Last N lines per process.")]
    = None,
) -> None:
    """The job's logs, each line prefixed cluster/host/rank. A host that cannot be reached is
    named on stderr and skipped (while following, retried until it answers)."""
    with _store() as store, Orchestrator(store) as orch:
        job = store.get_job(job_ref)
        colors = cluster_colors(job.clusters)
        follower = orch.jobs.follow_logs(job.id, cluster=cluster, host=host, rank=rank, tail=tail)
        if not follower.tails:
            raise NebulaError("no logs match those filters")
        try:
            while True:
                snap = orch.jobs.refresh(job.id) if follow else None
                final = snap is None or not snap.active
                for line in follower.poll(final=final):
                    print_line(out, line, colors)
                for problem in follower.reach.take():
                    err.print(f"[yellow]warning:[/] {escape(problem)}", markup=True,
                              highlight=False)
                if final:
                    break
                time.sleep(1.0)
        except KeyboardInterrupt:
            return
        for line in copy_tensorboard(orch.jobs, job.id):
            err.print(escape(line))
        if not follower.read_any:
            raise typer.Exit(EXIT_FAILED)


@app.command()
@handle_errors
def report(
    job_ref: Annotated[str, typer.Argument(metavar="JOB", help=JOB_HELP)],
    output: Annotated[Path | None, typer.Option(
        help="report.html (one self-contained page) or report.png. Default: "
             "`$NEBULA_HOME/jobs/<id>/report.html`.")] = None,
) -> None:
    """The job's metrics as one HTML page or PNG, and its TensorBoard runs.

    Loss by step and wall time, the throughput the job logged, round time, WAN bytes per round
    and the clusters present; restarts and missed rounds marked; the TensorBoard runs in
    `$NEBULA_HOME/jobs/<id>/tb`."""
    with _store() as store, Orchestrator(store) as orch:
        made = make_report(orch.jobs, store.get_job(job_ref).id, output)
    for warning in made.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}")
    for note in made.notes:
        err.print(f"note: {escape(note)}")
    if made.page is None and made.tensorboard is None:
        raise typer.Exit(EXIT_FAILED)
    tb = f"tensorboard --logdir {made.tensorboard}" if made.tensorboard else "none"
    out.print(f"{made.records} records; report: {made.page or 'none'}; TensorBoard: {tb}")


@app.command()
@handle_errors
def stop(
    job_ref: Annotated[str, typer.Argument(metavar="JOB", help=JOB_HELP)],
    grace: Annotated[float | None, typer.Option(
        help="Seconds between SIGTERM and SIGKILL. Default: the spec's `grace`.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Skip the grace period.")] = False,
) -> None:
    """Stop a job: SIGTERM every process group, wait the grace, SIGKILL. Nothing left running."""
    with _store() as store, Orchestrator(store) as orch:
        report = orch.jobs.stop(job_ref, grace=grace, force=force)
    if not report.stopped:
        out.print(f"{report.job.id} had already ended ({report.job.state.lower()}); "
                  "nothing was running")
        return
    for h in report.stopped:
        out.print(f"stopped {h.cluster}/{h.host} {h.role} (pid {h.pid or '-'})")
    for what in report.cancelled:
        out.print(f"cancelled {what}")
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
        report = run_bench(orch.facts, spec, duration=duration, streams=streams, intra=intra,
                           port=port, note=note, step=step)
    out.print(bench_matrix(report))
    if output is not None:
        write_report(report, output)
        out.print(f"figures written to {output}")
    for problem in report["errors"]:
        err.print(f"[bold red]error:[/] {problem}", markup=True, highlight=False)
    if report["errors"]:
        raise typer.Exit(EXIT_FAILED)


def _job_memory(spec: JobSpec, params: int) -> list[ClusterMemory]:
    return job_memory(params, {c.name: c.process_count for c in spec.clusters})


def _dry_run(spec: JobSpec, params: int | None, step_time: float | None,
             accept_new: bool) -> tuple[int, float]:
    """Fill in what was not given by running the job's script briefly (control.dryrun)."""
    with _store() as store, Orchestrator(store, accept_new_host_keys=accept_new) as orch:
        measured = measure(orch, spec, progress=lambda m: err.print(f"[dim]{m}[/]"))
    if params is None and measured.params is None:
        raise UsageError("the dry run timed the steps, but the script did not report its "
                         "trainable parameters (it reports them when it wraps its engine in "
                         "nebula_cli.runtime.OuterSync); give --params")
    return (params if params is not None else measured.params or 0,
            step_time if step_time is not None else measured.step_time_s)


class _PlanGroup(TyperGroup):
    """`nebula plan SPEC ...` means `nebula plan sync SPEC ...`; `nebula plan placement ...`
    stays a subcommand."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["sync", *args]
        return super().parse_args(ctx, args)


plan_app = typer.Typer(
    cls=_PlanGroup, no_args_is_help=True,
    help="Plan a job: how to sync across clusters (`nebula plan SPEC`), or which devices hold "
         "which pipeline stage (`nebula plan placement`).")
app.add_typer(plan_app, name="plan")


@plan_app.command("sync")
@handle_errors
def plan_sync(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="The job spec (YAML).")],
    params: Annotated[int | None, typer.Option(
        "--params", help="Trainable parameters (what travels each outer round). Default: "
        "measured by a dry run.")] = None,
    step_time: Annotated[float | None, typer.Option(
        "--step-time", help="Seconds of one inner step of a cluster. Default: measured by a "
        "dry run (the job's script on its first cluster, stopped after a few steps).")] = None,
    netbench: Annotated[Path | None, typer.Option(
        "--netbench", help="bench-network's JSON; the slowest pair of clusters is used.")] = None,
    bandwidth: Annotated[float | None, typer.Option(
        "--bandwidth", help="WAN throughput in Mbit/s (overrides --netbench).")] = None,
    rtt: Annotated[float | None, typer.Option(
        "--rtt", help="WAN round-trip time in ms (overrides --netbench).")] = None,
    overlap: Annotated[bool | None, typer.Option(
        "--overlap/--no-overlap", help="Sync overlapped with compute. Default: the spec's "
        "relay.sync.overlap.")] = None,
    target: Annotated[float, typer.Option(help="Utilisation to reach.")] = 0.95,
    as_json: Annotated[bool, typer.Option("--json", help="JSON for scripts.")] = False,
    accept_new: AcceptNew = False,
) -> None:
    """How many inner steps and which codec hide the WAN behind compute (DiLoCo mode)."""
    spec = load_spec(spec_path)
    clusters = [c.name for c in spec.clusters]
    rtt_ms, mbit = rtt, bandwidth
    if netbench is not None and (rtt_ms is None or mbit is None):
        measured_rtt, measured_mbit = wan_link(load_netbench(netbench), clusters)
        rtt_ms = measured_rtt if rtt_ms is None else rtt_ms
        mbit = measured_mbit if mbit is None else mbit
    if (rtt_ms is None or mbit is None) and len(clusters) > 1:
        raise UsageError("give --netbench FILE (from `nebula bench-network`), or both "
                         "--bandwidth MBIT and --rtt MS")
    if overlap is None:
        overlap = bool(spec.relay and spec.relay.sync.overlap)
    if spec.relay is not None and spec.relay.sync.mode == "gradient":
        err.print("[yellow]note:[/] the spec syncs every step (mode: gradient); this advice is "
                  "for mode: diloco", markup=True)
    if params is None or step_time is None:
        params, step_time = _dry_run(spec, params, step_time, accept_new)
    advice = advise(params, step_time, mbit or 1.0, rtt_ms or 0.0, clusters=len(clusters),
                    overlap=overlap, target=target)
    memory = _job_memory(spec, params)
    if as_json:
        out.print_json(json.dumps({**advice.to_json(),
                                   "outer_memory": [c.to_json() for c in memory]}))
    else:
        out.print(advisor_table(advice), outer_memory_table(params, memory))


@plan_app.command("placement")
@handle_errors
def plan_placement_cmd(
    stages: Annotated[int, typer.Option("--stages", help="Pipeline stages (D_PP).")],
    dp: Annotated[int, typer.Option("--dp", help="Data-parallel replicas (D_DP).")],
    activation_gb: Annotated[float, typer.Option(
        "--activation-gb", help="GB of activations per macro-batch between two stages.")],
    gradient_gb: Annotated[float, typer.Option(
        "--gradient-gb", help="GB of one stage's gradients.")],
    devices: Annotated[Path | None, typer.Option(
        "--devices", help='JSON: {"devices": [ids], "delay_ms": [[..]], '
        '"bandwidth_gbps": [[..]]}.')] = None,
    spec_path: Annotated[Path | None, typer.Option(
        "--spec", help="A job spec: every slot of every host is a device (needs --netbench).")]
    = None,
    netbench: Annotated[Path | None, typer.Option(
        "--netbench", help="bench-network's JSON, for --spec.")] = None,
    budget: Annotated[int, typer.Option(help="Candidate evaluations per search.")] = 5000,
    time_limit: Annotated[float | None, typer.Option(
        "--time-limit", help="Seconds the search may take (each baseline too); it stops with "
        "the best plan so far. Default: no limit, the budget decides.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same answer).")] = 0,
    baselines: Annotated[bool, typer.Option(
        "--baselines/--no-baselines", help="Also run the best of 100 random placements and "
        "local search alone at the same budget.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="JSON for scripts.")] = False,
) -> None:
    """Which device holds which pipeline stage of which replica (Yuan et al., NeurIPS 2022)."""
    if devices is not None and (spec_path is not None or netbench is not None):
        raise UsageError("give either --devices FILE, or --spec SPEC with --netbench FILE")
    if devices is not None:
        network = load_devices(devices)
    elif spec_path is not None and netbench is not None:
        network = devices_from_spec(load_spec(spec_path), load_netbench(netbench))
    else:
        raise UsageError("give --devices FILE, or --spec SPEC with --netbench FILE")
    task = Task(stages, dp, activation_gb, gradient_gb)
    CostModel(network, task)  # shape errors now, not after a long search
    limit = f" or {time_limit:g} s" if time_limit is not None else ""
    err.print(f"[dim]searching {network.size} devices, {stages} stages x {dp} replicas, "
              f"{budget} evaluations{limit}{' (+ 2 baselines)' if baselines else ''}...[/]")
    with placement_progress(err, time_limit) as on_progress:
        result = plan_placement(network, task, budget=budget, seed=seed, baselines=baselines,
                                time_limit=time_limit, on_progress=on_progress)
    if as_json:
        out.print_json(json.dumps(result.to_json()))
    else:
        out.print(placement_table(result))


def run() -> None:  # pragma: no cover - console entry point wrapper
    sys.exit(app())
