"""rich renderables: tables, log prefixes, the metrics panel, human units."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from nebula_cli.cli.fit import Column, FittedTable
from nebula_cli.cli.palette import cluster_colours
from nebula_cli.config.codec_knobs import FEEDBACK_DECAY
from nebula_cli.config.spec import JobSpec
from nebula_cli.control import final_parameters
from nebula_cli.control.follow import LogLine, finite
from nebula_cli.control.hostcheck import HostCheck
from nebula_cli.control.orchestrator import JobSnapshot
from nebula_cli.control.state import HostRecord, JobRecord
from nebula_cli.errors import SpecError

STATE_STYLE = {
    "RUNNING": "green", "STARTING": "cyan", "PENDING": "cyan", "QUEUED": "cyan",
    "RESTARTING": "yellow",
    "STOPPING": "yellow", "SUCCEEDED": "bold green", "FAILED": "bold red", "LOST": "bold red",
    "STOPPED": "dim",
}


def cluster_colors(clusters: Iterable[str]) -> dict[str, str]:
    """Each cluster's terminal colour (the report draws it in the same hue: `palette`)."""
    return {name: c.terminal for name, c in cluster_colours(clusters).items()}


def state_text(state: str) -> Text:
    return Text(state, style=STATE_STYLE.get(state, ""))


def human_bytes(n: float | None) -> str:
    if n is None or not finite(n):
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_duration(seconds: float | None) -> str:
    if seconds is None or not finite(seconds):
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def human_time(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def num(value: Any, fmt: str = ".3f") -> str:
    return format(value, fmt) if finite(value) else "-"


def job_duration(job: JobRecord) -> float | None:
    if job.started is None:
        return None
    return (job.ended or time.time()) - job.started


def exit_text(rec: HostRecord) -> str:
    codes = {r: c for r, c in (rec.detail.get("exit_codes") or {}).items() if c not in (None,)}
    if rec.exit_code is None and not codes:
        return "-"
    if len(codes) > 1:
        return " ".join(f"r{r}:{c}" for r, c in codes.items())
    return str(rec.exit_code if rec.exit_code is not None else next(iter(codes.values())))


def jobs_table(jobs: list[JobRecord]) -> FittedTable:
    """The jobs, each by its name and short id (what every command takes: `StateStore.get_job`),
    fitted to the terminal (`cli.fit`)."""
    table = FittedTable([
        Column("name"), Column("id", keep=95), Column("state", keep=98),
        Column("clusters", keep=40, wrap=True), Column("hosts", keep=30, justify="right"),
        Column("started", keep=50), Column("duration", keep=60, justify="right")],
        title="nebula jobs")
    for job in jobs:
        table.add_row(job.name, job.short_id, state_text(job.state), ", ".join(job.clusters),
                      str(job.num_hosts), human_time(job.started or job.created),
                      human_duration(job_duration(job)))
    return table


def sync_summary(spec: JobSpec) -> str:
    """How the relays sync, defaults resolved: "diloco every 100 steps, outer lr 0.7 / Nesterov
    momentum 0.9, int8 with error feedback"."""
    relay = spec.relay
    assert relay is not None
    sync, comp = relay.sync, relay.compression
    if sync.mode != "diloco":
        every = "every step"
    elif sync.every is not None:
        every = f"every {sync.every:g} s of training (weighted by samples)"
    elif sync.auto:
        every = (f"every H steps, H chosen by the relays ({sync.min_inner_steps}-"
                 f"{sync.max_inner_steps}) for {sync.target_utilization:.0%} utilisation")
    else:
        every = f"every {sync.inner_steps} steps"
    params = comp.params
    labels = " or ".join(params[c].label() for c in comp.codecs)
    codec = (labels if len(comp.codecs) == 1
             else f"codec chosen by the relays each round ({labels})")
    lossy = any(params[c].rel_error > 0 for c in comp.codecs)  # "none" has nothing to feed back
    decays = [f"{beta:g}{f' with {c}' if len(comp.codecs) > 1 else ''}"
              for c, beta in comp.decays.items() if beta != FEEDBACK_DECAY]
    decay = f" (decay {', '.join(decays)})" if decays else ""
    feedback = f" with error feedback{decay}" if comp.error_feedback and lossy else ""

    def outer(codec: str) -> str:
        lr, mom = relay.outer_for(codec)
        momentum = ("no momentum" if not mom else
                    f"{'Nesterov ' if sync.nesterov else ''}momentum {mom:g}")
        return f"outer lr {lr:g} / {momentum}"
    outers = "; ".join(f"{outer(c)}{f' with {c}' if len(comp.codecs) > 1 else ''}"
                       for c in comp.codecs)
    return (f"{sync.mode} {every}, {outers}"
            f"{', overlapped' if sync.overlap else ''}, {codec}{feedback}")


def spec_summary(path: object, spec: JobSpec) -> str:
    """What `validate` says of a valid spec: its size, which relay dials which and through
    what (`relay_reach`: an SSH tunnel to which host) and what each Slurm cluster asks for."""
    hosts = sum(c.node_count for c in spec.clusters)
    slots = sum(c.process_count for c in spec.clusters)
    lines = [f"[green]✓[/] {path} is valid: job [bold]{spec.name}[/], {len(spec.clusters)} "
             f"clusters, {hosts} hosts, {slots} processes"]
    if links := spec.links():
        by_name = {c.name: c for c in spec.clusters}
        lines.append("relays: " + ", ".join(
            f"{link.dialer} dials {link.dialled}" + (
                f" through an SSH tunnel to {by_name[link.dialled].ssh_host.host}"
                if link.tunnel else "") for link in links))
        lines.append("sync: " + sync_summary(spec))
    if spec.distill is not None:
        lines.append("distill: " + spec.distill.summary())
        lines.extend(f"[yellow]note:[/] {escape(note)}" for note in spec.distill.notes())
    for c in spec.clusters:
        if (said := c.scheduling.summary(c)) is not None:
            relay = "" if spec.relay is None else (
                ", relay on the login node" if c.relay_on == "login" else
                ", relay on the first node")
            lines.append(f"{c.name}: {said}{relay}")
    return "\n".join(lines)


def job_detail(snap: JobSnapshot, metrics: dict[str, dict[str, Any]] | None = None,
               relay: dict[str, dict[str, Any]] | None = None, attempt: int = 1,
               finals: list[dict[str, Any]] | None = None) -> Group:
    """A job's hosts, its newest metrics per cluster (workers' and relays'), and once it has
    ended, whether its workers hold the same parameters (from their ``finals`` records)."""
    job = snap.job
    colors = cluster_colors(job.clusters)
    head = Text.assemble(
        (job.id, "bold"), "  ", state_text(job.state),
        f"  started {human_time(job.started)}  ran {human_duration(job_duration(job))}",
        f"  attempt {attempt}" if attempt > 1 else "",
    )
    if job.reason and job.state in ("FAILED", "QUEUED"):
        head.append(f"\nreason: {job.reason}", style="red" if job.state == "FAILED" else "")
    table = FittedTable([
        Column("cluster"), Column("host"), Column("role", keep=90), Column("state", keep=95),
        Column("agent", keep=20, justify="right"), Column("pid", keep=25, justify="right"),
        Column("restarts", keep=60, justify="right"), Column("exit", keep=70, justify="right"),
        Column("note", keep=80, wrap=True, stack=True)], show_edge=False, name=(0, 1))
    for h in snap.hosts:
        note = h.detail.get("unreachable") or h.detail.get("metrics_unreachable") or (
            h.detail.get("reason") if h.state in ("FAILED", "LOST", "RESTARTING") else
            h.allocation_said)
        table.add_row(
            Text(h.cluster, style=colors.get(h.cluster, "")), h.host, h.role, state_text(h.state),
            str(h.detail.get("agent_pid") or "-"), str(h.pid or "-"), str(h.restarts),
            exit_text(h), note or "",
        )
    parts: list[Any] = [head, table]
    if metrics or relay:
        parts.append(metrics_table(job.clusters, metrics or {}, relay or {}))
        parts.extend(distill_verdict(job.clusters, metrics or {}))
    parts.extend(parameter_verdict(final_parameters.of_job(job, finals or [])))
    return Group(*parts)


def _rate(m: dict[str, Any]) -> str:
    """tokens/s, or samples/s from a script nebula cannot count tokens of (the runtime hook)."""
    if finite(m.get("tokens_per_s")):
        return num(m["tokens_per_s"], ".0f")
    if finite(m.get("samples_per_s")):
        return num(m["samples_per_s"], ".1f") + " smp"
    return "-"


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 20) -> str:
    """The last `width` values as bars scaled between their min and max ("" when none)."""
    values = [v for v in values if finite(v)][-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARKS[round((v - low) / span * (len(SPARKS) - 1))] for v in values)


def metrics_table(
    clusters: list[str], latest: dict[str, dict[str, Any]], relay: dict[str, dict[str, Any]],
    history: dict[str, Any] | None = None,
) -> FittedTable:
    """Per cluster: step, losses (with a sparkline of the recent train loss when `history`
    holds the cluster's records), tokens/s, soft labels (in a job with students), outer round,
    round time, WAN bytes, present, the newest checkpoint (and whether saving fails). In a
    job with distillation the soft labels column says a student cluster's batches with labels
    and a teacher cluster's answers per second, their latency and the queue."""
    colors = cluster_colors(clusters)
    distill = any(key in latest.get(name, {}) for name in clusters
                  for key in ("distill_batches", "teacher_answers"))
    table = FittedTable([
        Column("cluster"), Column("step", keep=90, justify="right"),
        Column("loss", keep=85, justify="right"),
        *([Column("loss trend", keep=30)] if history else []),
        Column("eval loss", keep=70, justify="right"),
        Column("tokens/s\n(or samples/s)", keep=75, justify="right"),
        *([Column("soft labels", keep=65, justify="right", wrap=True, stack=True)]
          if distill else []),
        Column("round", keep=80, justify="right"), Column("round time", keep=50, justify="right"),
        Column("WAN sent", keep=45, justify="right"), Column("WAN recv", keep=40, justify="right"),
        Column("present", keep=55, justify="right"),
        Column("checkpoint", keep=60, justify="right", wrap=True, stack=True)],
        show_edge=False)
    for name in clusters:
        m = latest.get(name, {})
        r = relay.get(name, {})
        present = m.get("clusters_present", r.get("present"))
        if isinstance(present, list):
            present = len(present)
        trend = [sparkline([r.get("loss") for r in (history or {}).get(name, [])])] \
            if history else []
        table.add_row(
            Text(name, style=colors[name]), str(m.get("step", "-")), num(m.get("loss")),
            *trend, num(m.get("eval_loss")), _rate(m), *([_soft_labels(m)] if distill else []),
            str(m.get("outer_round", r.get("round", "-"))),
            num(m.get("round_s", r.get("round_s")), ".2f") + ("s" if finite(
                m.get("round_s", r.get("round_s"))) else ""),
            human_bytes(r.get("bytes_sent_total", m.get("wan_bytes_sent"))),
            human_bytes(r.get("bytes_received_total", m.get("wan_bytes_received"))),
            str(present if present is not None else "-"), _checkpoint(m),
        )
    return table


def _soft_labels(m: dict[str, Any]) -> Text:
    """A student cluster's batches trained with its teacher's soft labels, of all so far, how
    many went without (when_no_teacher: ce_only) in yellow, and its recent KD term (the
    loader's last interval, where the script trains with `kd_loss`); a teacher cluster's answers per
    second, their latency and its queue (in yellow when asks wait)."""
    if "teacher_answers" in m:
        queue = int(m.get("teacher_queue") or 0)
        out = Text(f"{num(m.get('teacher_answers_per_s'), '.1f')} answers/s, "
                   f"{num(m.get('teacher_latency_ms'), '.0f')} ms")
        out.append(f", queue {queue}", style="yellow" if queue else "")
        if finite(m.get("teacher_ce")):
            out.append(f", CE {num(m['teacher_ce'], '.3f')}")
        return out
    if "distill_batches" not in m:
        return Text("-")
    total, without = int(m["distill_batches"]), int(m.get("distill_without_labels") or 0)
    out = Text(f"{total - without}/{total}")
    if without:
        out.append(f" ({without} without)", style="yellow")
    if m.get("distill_kd") is not None:
        out.append(f", KD {num(m['distill_kd'], '.3f')}")
    if finite(m.get("distill_ce")):
        out.append(f", CE {num(m['distill_ce'], '.3f')}")
    return out


def distill_verdict(clusters: list[str], latest: dict[str, dict[str, Any]]) -> list[Text]:
    """Under the metrics of a distillation: the teachers' and the students' loss on the
    students' batches side by side (`teacher_ce`, `distill_ce`: cross entropy at temperature
    1), and a warning when no teacher is better than a student there: distillation cannot
    help it. Empty until both have been measured."""
    teachers = {c: latest[c]["teacher_ce"] for c in clusters
                if finite(latest.get(c, {}).get("teacher_ce"))}
    students = {c: latest[c]["distill_ce"] for c in clusters
                if finite(latest.get(c, {}).get("distill_ce"))}
    if not teachers or not students:
        return []
    line = Text("loss on the students' batches: " + ", ".join(
        [*(f"teacher {c} {v:.3f}" for c, v in teachers.items()),
         *(f"student {c} {v:.3f}" for c, v in students.items())]), style="dim")
    best = min(teachers.values())
    behind = [c for c, v in students.items() if v <= best]
    if not behind:
        return [line]
    return [line, Text(
        f"the teacher is no better than student {', '.join(behind)} on its own batches "
        f"(CE {best:.3f} against {min(students[c] for c in behind):.3f}): distillation cannot "
        "help it; check the teacher's model (its checkpoint, its tokenizer) or train without "
        "it", style="yellow")]


def _checkpoint(m: dict[str, Any]) -> Text:
    """The newest checkpoint's step; `failing` when the newest save failed; `resumed N` when
    the workers started from a checkpoint."""
    out = Text(str(m["checkpoint_step"]) if m.get("checkpoint_step") is not None else "-")
    if m.get("resumed_from_step") is not None:
        out.append(f" (resumed {m['resumed_from_step']})")
    if m.get("checkpoint_error"):
        out.append(" failing", style="red")
    return out


def status_panel(snap: JobSnapshot, latest: dict[str, Any], relay: dict[str, Any],
                 history: dict[str, Any] | None = None) -> Panel:
    counts: dict[str, int] = {}
    for h in snap.hosts:
        counts[h.state] = counts.get(h.state, 0) + 1
    summary = Text.assemble(
        (snap.job.id, "bold"), "  ", state_text(snap.job.state), "  ",
        ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())),
        f"  {human_duration(job_duration(snap.job))}",
    )
    parts: list[Any] = [summary]
    if latest or relay:
        parts.append(metrics_table(snap.job.clusters, latest, relay, history))
        parts.extend(distill_verdict(snap.job.clusters, latest))
    return Panel(Group(*parts), title="nebula", title_align="left", border_style="dim")


def log_text(line: LogLine, colors: dict[str, str]) -> Text:
    prefix = f"{line.cluster}/{line.host}/{line.rank}"
    return Text.assemble((prefix, colors.get(line.cluster, "")), (" | ", "dim"), line.text)


def spec_error_text(err: SpecError) -> Text:
    problems = err.problems or [err]
    text = Text()
    for i, p in enumerate(problems):
        if i:
            text.append("\n")
        text.append(p.location(), style="bold")
        if p.field:
            text.append(f": {p.field}", style="cyan")
        text.append(f": {p.message}")
    return text


def final_summary(finals: list[dict[str, Any]], clusters: list[str],
                  said: final_parameters.ParameterVerdict | None) -> Group | None:
    """The workers' final records: losses, speed, and whether the workers that should hold the
    same parameters do (every worker; in a pipelined job, the replicas of each stage)."""
    if not finals:
        return None
    colors = cluster_colors(clusters)
    staged = any("stage" in f for f in finals)
    table = FittedTable([
        Column("cluster"), Column("host", keep=95), Column("rank", keep=90, justify="right"),
        *([Column("stage/replica", keep=85, justify="right")] if staged else []),
        Column("step", keep=80, justify="right"), Column("first loss", keep=40, justify="right"),
        Column("last loss", keep=75, justify="right"),
        Column("eval loss", keep=70, justify="right"), Column("s/step", keep=50, justify="right"),
        Column("parameters sha256", keep=60, justify="right")],
        title="summary", show_edge=False, name=(0, 1, 2))
    ordered = sorted(finals, key=lambda f: (clusters.index(f["cluster"])
                                            if f["cluster"] in clusters else 99,
                                            str(f.get("rank"))))
    for f in ordered:
        where = [f"{f.get('stage', '-')}/{f.get('replica', '-')}"] if staged else []
        table.add_row(Text(f["cluster"], style=colors.get(f["cluster"], "")), f["host"],
                      str(f.get("rank", "-")), *where, str(f.get("step", "-")),
                      num(f.get("first_loss")), num(f.get("last_loss")), num(f.get("eval_loss")),
                      num(f.get("s_per_step"), ".2f"), str(f.get("param_sha256", "-"))[:16])
    return Group(table, *parameter_verdict(said))


def parameter_verdict(said: final_parameters.ParameterVerdict | None) -> list[Text]:
    """Whether the workers that should hold the same parameters do (green or bold red; see
    `control.final_parameters.of_job`); nothing to say without a verdict."""
    if said is None:
        return []
    return [Text(said.sentence(), style="green" if said.identical else "bold red")]


def host_checks_table(checks: list[HostCheck]) -> FittedTable:
    """`validate --hosts`: one row per host, failures named; below, what each scheduler said
    it would give the spec (a Slurm login node's ``sbatch --test-only``)."""
    colors = cluster_colors(dict.fromkeys(c.cluster for c in checks))
    said = [f"{c.cluster}/{c.host}: {c.scheduler}" for c in checks if c.scheduler]
    table = FittedTable([
        Column("cluster"), Column("host"), Column("reachable", keep=90), Column("python", keep=60),
        Column("torch", keep=55), Column("deepspeed", keep=50),
        Column("free disk", keep=45, justify="right"), Column("slots", keep=40, justify="right"),
        Column("interface", keep=35), Column("problems", keep=95, wrap=True, stack=True)],
        title="hosts", show_edge=False, name=(0, 1),
        caption=Text("\n".join(said)) if said else None)
    for c in checks:
        table.add_row(
            Text(c.cluster, style=colors.get(c.cluster, "")), c.host,
            Text("yes", style="green") if c.reachable else Text("no", style="red"),
            c.python or "-", c.torch or "-", c.deepspeed or "-", human_bytes(c.free_bytes),
            str(c.slots), c.interface or "-",
            Text("; ".join(c.problems), style="red") if c.problems else "",
        )
    return table


@contextmanager
def upload_bars(console: Console) -> Iterator[tuple[Callable[[str], None],
                                                    Callable[[str, int, int], None]]]:
    """Progress bars for uploads, one per host and payload, with messages printed above."""
    bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), console=console, transient=True)
    tasks: dict[str, TaskID] = {}

    def note(message: str) -> None:
        bars.console.print(Text(message, style="dim"))

    def transfer(what: str, done: int, total: int) -> None:
        if what not in tasks:
            tasks[what] = bars.add_task(what, total=total)
        bars.update(tasks[what], completed=done, total=total)

    with bars:
        yield note, transfer
