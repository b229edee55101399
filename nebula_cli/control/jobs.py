"""What happens to a launched job: status (asking every agent), stop, and following its logs
and metrics. `JobOps` is the part of the orchestrator that works on recorded jobs."""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from nebula_cli.config import plan_model
from nebula_cli.config.roles.registry import serving_clusters
from nebula_cli.control import allocations, summaries
from nebula_cli.control.fanout import GroupError, fanout
from nebula_cli.control.follow import LogFollower, MetricsFollower
from nebula_cli.control.renewal import renew_if_due
from nebula_cli.control.session import Session
from nebula_cli.control.state import ACTIVE_STATES, END_STATES, HostRecord, JobRecord
from nebula_cli.errors import NebulaError, TransportError
from nebula_cli.scheduler.allocation_state import AllocationState


@dataclass
class JobSnapshot:
    """A job as last seen: its record and every agent's record."""

    job: JobRecord
    hosts: list[HostRecord]

    @property
    def active(self) -> bool:
        return any(h.state in ACTIVE_STATES for h in self.hosts)


@dataclass
class StopReport:
    job: JobRecord
    stopped: list[HostRecord] = field(default_factory=list)  # were active, now ended
    already_ended: list[HostRecord] = field(default_factory=list)
    swept: int = 0  # stray processes killed by the sweep
    cancelled: list[str] = field(default_factory=list)  # Slurm jobs scancel'd


FAILURE_STOP_GRACE = 5.0
"""Seconds the other processes of a job get to end once a worker failed for good (they are
most likely blocked in a collective with it; longer would only keep GPUs idle)."""


def training(hosts: list[HostRecord], servers: frozenset[str]) -> list[HostRecord]:
    """The workers that train: not those of the `servers` clusters (a teacher's)."""
    return [h for h in hosts if h.role == plan_model.WORKER and h.cluster not in servers]


def failed_workers(hosts: list[HostRecord],
                   servers: frozenset[str] = frozenset()) -> list[HostRecord]:
    """Training worker agents that failed for good (restarts used up) or were lost; those of
    the `servers` clusters (a teacher's) are not the training's: see `failed_servers`."""
    return [h for h in training(hosts, servers) if h.state in ("FAILED", "LOST")]


def failed_servers(hosts: list[HostRecord], servers: frozenset[str]) -> list[HostRecord]:
    """Workers of the `servers` clusters that failed for good or were lost: their cluster
    ends, the training goes on (the students follow `distill.when_no_teacher`)."""
    return [h for h in hosts if h.role == plan_model.WORKER and h.cluster in servers
            and h.state in ("FAILED", "LOST")]


def survivors(hosts: list[HostRecord], min_clusters: int | None,
              servers: frozenset[str] = frozenset()) -> set[str] | None:
    """The clusters training on without the lost ones (those with a failed worker), when the
    spec's `min_clusters` lets them (None: the job stands or falls as a whole)."""
    lost = {h.cluster for h in failed_workers(hosts, servers)}
    rest = {h.cluster for h in hosts} - lost
    return rest if lost and min_clusters and len(rest) >= min_clusters else None


def job_state(hosts: list[HostRecord], current: str, min_clusters: int | None = None,
              servers: frozenset[str] = frozenset()) -> str:
    """The job's state from its agents' states. Relays and the workers of the `servers`
    clusters (`registry.serving_clusters`: teachers) serve the training workers: once those
    are done, services ended by nebula do not make the job STOPPED, and a serving cluster
    that failed does not fail the job (its hosts say FAILED). With `min_clusters`, lost
    clusters do not count while enough others remain."""
    if (rest := survivors(hosts, min_clusters, servers)) is not None:
        hosts = [h for h in hosts if h.cluster in rest]
    states = {h.state for h in hosts}
    if not hosts:
        return current
    if states & ACTIVE_STATES:
        return "RUNNING"
    if {h.state for h in hosts if h.cluster not in servers} & {"FAILED", "LOST"}:
        return "FAILED"
    workers = {h.state for h in training(hosts, servers)} or states
    if "STOPPED" in workers:
        return "STOPPED"
    return "SUCCEEDED"


class JobOps:
    """status / stop / logs of recorded jobs, through the hosts' agents (of `session`)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.store = session.store

    # -- status -----------------------------------------------------------------------------
    def _by_machine(self, hosts: list[HostRecord]) -> dict[tuple[Any, ...], list[HostRecord]]:
        groups: dict[tuple[Any, ...], list[HostRecord]] = defaultdict(list)
        for rec in hosts:
            groups[rec.conn.machine_key()].append(rec)
        return groups

    def _agent_call(self, recs: list[HostRecord], *args: str, timeout: float) -> list[dict]:
        conn = recs[0].conn
        result = self.session.transport(conn).run(
            self.session.agent_argv(conn, *args, *[r.agent_dir for r in recs]), timeout=timeout
        )
        try:
            replies = json.loads(result.stdout)
        except json.JSONDecodeError as exc:
            raise TransportError(f"agent did not answer: {result}", host=conn.name) from exc
        if not isinstance(replies, list) or len(replies) != len(recs):
            raise TransportError(f"agent gave an unexpected answer: {result}", host=conn.name)
        return replies

    def refresh(self, ref: str) -> JobSnapshot:
        """Ask every agent of an unfinished job for its state; record changes; derive the job's."""
        job = self.store.get_job(ref)
        servers = serving_clusters(job.spec)  # a teacher's clusters: they serve the training
        hosts = self.store.hosts(job.id)
        live = [h for h in hosts if h.state not in END_STATES]
        # on Slurm: hosts STOPPED while the job runs were stopped by Slurm's notice (a time
        # limit, preemption): the job waits for the allocation's end to say which
        noticed = [h for h in hosts if h.state == "STOPPED" and h.role == plan_model.WORKER
                   and job.state == "RUNNING"]
        said = self._end_with_allocations(job.id, live + noticed)
        hosts = self.store.hosts(job.id)
        live = [h for h in hosts if h.state not in END_STATES]
        if live:
            groups = self._by_machine(live)
            try:
                answers = fanout(
                    list(groups), lambda k: self._agent_call(groups[k], "status", timeout=30),
                    timeout=60, cancel=self.session.abort,
                )
            except GroupError as exc:
                answers = {k: v for k, v in exc.results.items() if isinstance(v, list)}
                for key, err in exc.failures.items():
                    for rec in groups[key]:  # type: ignore[index]
                        rec.detail["unreachable"] = str(err)
                        self.store.upsert_host(rec)
            for key, replies in answers.items():
                for rec, status in zip(groups[key], replies, strict=True):
                    self._apply_status(rec, status)
            hosts = self.store.hosts(job.id)
            if job.state == "RUNNING" and self._revive_lost(hosts):
                hosts = self.store.hosts(job.id)
            if job.state == "RUNNING":
                try:
                    renew_if_due(self.store, job, hosts, self.session.transport_of,
                                 self.session.abort)
                except (NebulaError, OSError, ValueError) as exc:  # status still answers
                    self.store.add_event(job.id, "warning", f"certificate renewal: {exc}")
                hosts = self.store.hosts(job.id)
            if job.state == "RUNNING" and self._end_after_failure(
                    hosts, job.spec.get("min_clusters"), servers):
                hosts = self.store.hosts(job.id)
            if job.state not in ("PENDING", "QUEUED") and self._end_idle_services(
                    hosts, servers):
                hosts = self.store.hosts(job.id)
        waiting = any(h.role == plan_model.WORKER and h.state == "STOPPED" and h.cluster in said
                      and not allocations.ended_state(said[h.cluster]) for h in hosts)
        if job.state == "RUNNING" and not waiting:  # launching and ended jobs keep theirs
            state = job_state(hosts, job.state, job.spec.get("min_clusters"), servers)
            if state != job.state:
                failed = [h for h in hosts if h.state in ("FAILED", "LOST")]
                reason = "; ".join(
                    f"{h.cluster}/{h.host} {h.role}: {h.detail.get('reason') or h.state}"
                    for h in failed
                ) or None
                ends = [h.detail.get("ended") for h in training(hosts, servers)]
                at = max(ends) if ends and all(ends) and state in END_STATES else None
                self.store.set_job_state(job.id, state, reason=reason, at=at)
                self.store.add_event(job.id, "state", f"job {state.lower()}")
                job = self.store.get_job(job.id)
        return JobSnapshot(job=job, hosts=hosts)

    def _revive_lost(self, hosts: list[HostRecord]) -> bool:
        """Agents that died while their job runs (LOST: SIGKILL, the OOM killer, a host's
        reboot) are replaced on their hosts (`agent revive`): the new agent ends what the old
        one left and restarts it as a failed rank is restarted, or records FAILED with what to
        do when no restarts are left. Until a `status` or the live view runs, a dead agent's
        processes run on unsupervised."""
        lost = [h for h in hosts if h.state == "LOST" and h.detail.get("agent_lost")]
        if not lost:
            return False
        groups = self._by_machine(lost)
        try:
            answers = fanout(list(groups), lambda k: self._agent_call(
                groups[k], "revive", timeout=60), timeout=90, cancel=self.session.abort)
        except GroupError as exc:
            answers = {k: v for k, v in exc.results.items() if isinstance(v, list)}
        for key, replies in answers.items():
            for rec, reply in zip(groups[key], replies, strict=True):
                self._apply_status(rec, reply)
        return True

    def _end_idle_services(self, hosts: list[HostRecord], servers: frozenset[str]) -> bool:
        """Once every training worker has ended, the relays and the serving clusters' workers
        (a teacher's, which serve until told to stop) have nothing left to do: end them."""
        workers = training(hosts, servers)
        services = [h for h in hosts if h.state not in END_STATES
                    and (h.role == plan_model.RELAY or h.cluster in servers)]
        if not services or not workers or any(w.state not in END_STATES for w in workers):
            return False
        self._stop_recs(services, "ended after the training finished", grace=None)
        return True

    def _end_after_failure(self, hosts: list[HostRecord], min_clusters: int | None,
                           servers: frozenset[str] = frozenset()) -> bool:
        """A worker that failed for good (its restarts used up) leaves the other ranks of its
        DeepSpeed world waiting in a collective: end every process of the job at once (the job
        is FAILED with that worker's reason), or, when `min_clusters` lets the others train on,
        every process of its cluster. A serving cluster's (a teacher's) failed worker ends
        that cluster alone: the students go on without it."""
        ended = self._end_failed_servers(hosts, servers)
        if ended:
            hosts = self.store.hosts(hosts[0].job_id)
        failed = failed_workers(hosts, servers)
        active = [h for h in hosts if h.state not in END_STATES]
        if not failed or not active:
            return ended
        first = failed[0]
        why = (f"stopped: {first.cluster}/{first.host} {first.role} "
               f"{first.detail.get('reason') or first.state.lower()}")
        if (rest := survivors(hosts, min_clusters, servers)) is not None:
            active = [h for h in active if h.cluster not in rest]
            if not active:
                return ended
            lost = sorted({h.cluster for h in active})
            why = (f"cluster(s) {', '.join(lost)} lost ({why}); {len(rest)} of "
                   f"{len({h.cluster for h in hosts})} clusters train on "
                   f"(min_clusters {min_clusters})")
        self.store.add_event(first.job_id, "failure", why)
        self._stop_recs([h for h in active if h.role == plan_model.WORKER], why,
                        grace=FAILURE_STOP_GRACE)
        self._stop_recs([h for h in active if h.role == plan_model.RELAY], why,
                        grace=FAILURE_STOP_GRACE, leave=rest is not None)
        self._sweep_recs(failed)  # what a failed agent left running (its world's teller)
        return True

    def _end_failed_servers(self, hosts: list[HostRecord], servers: frozenset[str]) -> bool:
        """End what is left of each serving cluster with a worker that failed for good."""
        failed = failed_servers(hosts, servers)
        lost = sorted({h.cluster for h in failed})
        rest = [h for h in hosts if h.cluster in lost and h.state not in END_STATES]
        if not rest:
            return False
        first = failed[0]
        why = (f"teacher cluster(s) {', '.join(lost)} lost ({first.cluster}/{first.host} "
               f"{first.detail.get('reason') or first.state.lower()}); the students go on "
               "with the other teachers, or as distill.when_no_teacher says")
        self.store.add_event(first.job_id, "failure", why)
        self._stop_recs(rest, why, grace=FAILURE_STOP_GRACE)
        self._sweep_recs(failed)
        return True

    def _sweep_recs(self, recs: list[HostRecord]) -> None:
        """`stop --force` on agents that have ended, for what they may have left behind; their
        recorded state and reason stay as they are (best effort)."""
        groups = self._by_machine(recs)
        with contextlib.suppress(GroupError):
            fanout(list(groups), lambda k: self._agent_call(groups[k], "stop", "--force",
                                                            timeout=60),
                   timeout=90, cancel=self.session.abort)

    def _stop_recs(self, recs: list[HostRecord], reason: str, grace: float | None,
                   leave: bool = False) -> None:
        """Stop these agents (best effort: an unreachable host keeps its last state).
        `leave`: their clusters leave the job for good (their relays tell the others' not to
        wait for them at the end)."""
        if not recs:
            return
        groups = self._by_machine(recs)
        args = ["stop", *(["--grace", str(grace)] if grace is not None else []),
                *(["--leave"] if leave else [])]
        try:
            answers = fanout(list(groups), lambda k: self._agent_call(
                groups[k], *args, timeout=60 + (grace or 0)), timeout=90 + (grace or 0),
                cancel=self.session.abort)
        except GroupError as exc:
            answers = {k: v for k, v in exc.results.items() if isinstance(v, list)}
        for key, replies in answers.items():
            for rec, reply in zip(groups[key], replies, strict=True):
                reply["reason"] = reason
                self._apply_status(rec, reply)

    def _end_with_allocations(self, job_id: str,
                              hosts: list[HostRecord]) -> dict[str, AllocationState]:
        """Hosts of an allocation (a Slurm job) note its state; those of one that has ended
        are gone with it: workers SUCCEEDED if their agent said so, else LOST with the
        allocation's state as the reason ("Slurm job 12 TIMEOUT"); relays STOPPED (workers
        decide the job). What each cluster's scheduler said (`allocations.queue_states`)."""
        said = allocations.queue_states(self.store.job_dir(job_id), self.session.transport,
                                        {h.cluster for h in hosts}) if hosts else {}
        for rec in (h for h in hosts if h.cluster in said and h.conn.in_allocation):
            rec.detail[str(rec.conn.allocator)] = str(said[rec.cluster])  # allocation_said
            if not allocations.ended_state(said[rec.cluster]):
                self.store.upsert_host(rec)
                continue
            status = allocations.last_status(self.session.transport_of(rec), rec.agent_dir)
            done = status.get("state") == "SUCCEEDED" or rec.role == plan_model.RELAY
            ended = status.get("state") if status.get("state") in END_STATES else "STOPPED"
            self._apply_status(rec, {**status,
                                     "reason": None if done else str(said[rec.cluster]),
                                     "state": ended if done else "LOST"})
        return said

    def _apply_status(self, rec: HostRecord, status: dict[str, Any]) -> None:
        state = status.get("state", rec.state)
        if state == "PENDING" and rec.state != "PENDING":
            state = "LOST"  # status.json vanished after the agent had started
        changed = state != rec.state
        rec.state = state
        rec.pid = status.get("pid") or rec.pid
        rec.pgid = status.get("pgid") or rec.pgid
        rec.exit_code = status.get("exit_code", rec.exit_code)
        rec.restarts = int(status.get("restarts") or 0)
        rec.detail.update({
            "reason": status.get("reason"), "exit_codes": status.get("exit_codes") or {},
            "agent_pid": status.get("agent_pid"), "started": status.get("started"),
            "ended": status.get("ended"), "group_alive": status.get("group_alive"),
            "agent_lost": bool(status.get("agent_lost")),
        })
        rec.detail.pop("unreachable", None)
        if isinstance(status.get("metrics"), dict):
            summaries.store(rec, status["metrics"], source=summaries.AGENT)
        self.store.upsert_host(rec)
        if changed:
            why = f" ({rec.detail['reason']})" if rec.detail.get("reason") else ""
            self.store.add_event(rec.job_id, "host-state", f"{rec.role} {state.lower()}{why}",
                                 cluster=rec.cluster, host=rec.host)

    # -- stop -------------------------------------------------------------------------------
    def stop(self, ref: str, *, grace: float | None = None, force: bool = False) -> StopReport:
        """End every process group of the job on every host. Ending an ended job is fine.
        `grace` None: each agent's own (the spec's `grace` for workers)."""
        snap = self.refresh(ref)
        report = StopReport(job=snap.job)
        groups: dict[tuple[Any, ...], list[HostRecord]] = defaultdict(list)
        said = allocations.queue_states(self.store.job_dir(snap.job.id), self.session.transport,
                                        {h.cluster for h in snap.hosts})
        for rec in snap.hosts:  # one agent call per machine and role
            if allocations.ended_state(said.get(rec.cluster)) and rec.conn.in_allocation:
                report.already_ended.append(rec)  # gone with its Slurm allocation
                continue
            groups[(rec.role, *rec.conn.machine_key())].append(rec)
        args = ["stop", *(["--grace", str(grace)] if grace is not None else []),
                *(["--force"] if force else [])]
        spec_grace = float(snap.job.spec.get("grace") or 0.0)
        said = f"grace {grace:g} s" if grace is not None else f"the spec's grace, {spec_grace:g} s"
        self.store.add_event(snap.job.id, "stop", f"stop requested ({said})")
        grace = spec_grace if grace is None else grace
        failures: dict[object, object] = {}
        answers: dict[object, list[dict[str, Any]]] = {}
        # workers first, relays after: a last outer round as workers wind down reaches them
        for role in (plan_model.WORKER, plan_model.RELAY):
            keys = [k for k in groups if k[0] == role]
            try:
                answers.update(fanout(
                    keys, lambda k: self._agent_call(groups[k], *args, timeout=grace + 60),
                    timeout=grace + 90, cancel=self.session.abort))
            except GroupError as exc:
                answers.update({k: v for k, v in exc.results.items() if isinstance(v, list)})
                failures.update(exc.failures)
        for key, replies in answers.items():
            for rec, reply in zip(groups[key], replies, strict=True):
                was_active = rec.state not in END_STATES
                self._apply_status(rec, reply)
                report.swept += len(reply.get("swept") or [])
                (report.stopped if was_active else report.already_ended).append(rec)
        try:  # after the agents (their workers checkpoint): nothing left in a Slurm queue
            report.cancelled = allocations.cancel_all(
                self.store.job_dir(snap.job.id), self.session.transport, lambda _: None)
        except NebulaError as exc:
            failures["slurm"] = exc
        hosts = self.store.hosts(snap.job.id)
        if snap.job.state not in END_STATES or report.stopped:
            final = "STOPPED" if not any(h.state in ("FAILED", "LOST") for h in report.stopped) \
                else "FAILED"
            self.store.set_job_state(snap.job.id, final if report.stopped else
                                     job_state(hosts, snap.job.state,
                                               servers=serving_clusters(snap.job.spec)))
        report.job = self.store.get_job(snap.job.id)
        if failures:
            def label(key: object) -> str:
                return ", ".join(sorted({f"{r.cluster}/{r.host}" for r in groups[key]}))  # type: ignore[index]

            raise GroupError({**{label(k): "stopped" for k in answers},
                              **{label(k): v for k, v in failures.items()}})
        return report

    # -- logs and metrics -------------------------------------------------------------------
    def metrics_view(self, snap: JobSnapshot) -> summaries.MetricsView:
        """The job's newest metrics from its agents' summaries (kept by `refresh`); hosts
        that ended since, or whose agent gives no summary, are asked once more, in parallel.
        A host that cannot be reached keeps the figures last seen."""
        need = [h for h in snap.hosts if summaries.needs_summary(h)]
        if need:
            groups = self._by_machine(need)
            try:
                answers = fanout(list(groups), lambda k: self._summaries_of(groups[k]),
                                 timeout=60, cancel=self.session.abort)
            except GroupError as exc:
                answers = {k: v for k, v in exc.results.items() if isinstance(v, list)}
                for key, err in exc.failures.items():
                    for rec in groups[key]:  # type: ignore[index]
                        rec.detail["metrics_unreachable"] = str(err)
            for key, found in answers.items():
                for rec, (ranks, source) in zip(groups[key], found, strict=True):
                    summaries.store(rec, ranks, source=source)
                    rec.detail.pop("metrics_unreachable", None)
                    self.store.upsert_host(rec)
        return summaries.view(snap.hosts)

    def _summaries_of(self, recs: list[HostRecord]) -> list[tuple[dict[str, Any], str]]:
        """(summaries, source) of each of one machine's agents."""
        replies = self._agent_call(recs, "status", timeout=30)
        transport = self.session.transport(recs[0].conn)
        out = []
        for rec, reply in zip(recs, replies, strict=True):
            if isinstance(reply.get("metrics"), dict):
                out.append((reply["metrics"], summaries.AGENT))
            else:  # an agent from before summaries: read the files' tails ourselves
                out.append((summaries.read_summaries(transport, rec), summaries.TAIL))
        return out

    def follow_logs(self, ref: str, **filters: Any) -> LogFollower:
        job = self.store.get_job(ref)
        return LogFollower(self.store.hosts(job.id), self.session.transport_of, **filters)

    def follow_metrics(self, ref: str) -> MetricsFollower:
        job = self.store.get_job(ref)
        return MetricsFollower(self.store.hosts(job.id), self.session.transport_of)
