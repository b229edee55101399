"""launch: a spec turned into a plan and carried out over transports, recorded in the store.

The orchestrator only talks to host agents (through `python -m nebula_cli.agent ...` run over a
transport); it never signals a worker itself. Status, stop and logs live in `jobs`.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nebula_cli.config import checkpoint_paths, plan_model, strict, worlds
from nebula_cli.config.parts import helper_env
from nebula_cli.config.plan_model import AgentPlan, JobPlan
from nebula_cli.config.spec import ClusterSpec, HostSpec, JobSpec, spec_of_record
from nebula_cli.control import allocations, teacher_source
from nebula_cli.control.fanout import GroupError, fanout
from nebula_cli.control.hostcheck import HostCheck, bootstrap, check_host, require_python
from nebula_cli.control.jobs import JobOps, JobSnapshot, StopReport, job_state
from nebula_cli.control.planning import AGENT_TIMEOUT, HostFacts, describe_host
from nebula_cli.control.session import Session
from nebula_cli.control.state import (
    END_STATES,
    ROTATED_KEY,
    HostRecord,
    JobRecord,
    StateStore,
)
from nebula_cli.errors import (
    LaunchError,
    NebulaError,
    SpecError,
    TransportError,
    UsageError,
)
from nebula_cli.scheduler.allocation import Allocation
from nebula_cli.scheduler.base import Progress
from nebula_cli.scheduler.registry import allocator_named, allocator_of
from nebula_cli.transport import Transport

__all__ = ["JobSnapshot", "Orchestrator", "StopReport", "job_state"]

SETUP_TIMEOUT = 3600.0
PACKAGE_DIR = Path(__file__).resolve().parent.parent
CANCEL_STOP_TIMEOUT = 6.0
"""Seconds a cancelled launch gives its hosts' agents to stop (the command ends within 10 s)."""

RESUME_EVENT = "resume"
"""The event kind a resume records; a job's attempt is 1 + their number."""

Transfer = Callable[[str, int, int], None]  # (what, bytes done, bytes in all)


def _quiet(_: str) -> None:
    pass


class Orchestrator:
    """Carries out commands on a job's hosts: launch and resume here, status / stop / logs by
    its `jobs`, the plan's inputs by its `facts`, both over one `session` (its connections,
    reused). Close it to release them."""

    def __init__(self, store: StateStore, *, accept_new_host_keys: bool = False) -> None:
        self.store = store
        self.session = Session(store, accept_new_host_keys=accept_new_host_keys)
        self.jobs = JobOps(self.session)
        self.facts = HostFacts(self.session)
        self._placing = threading.Lock()
        """One teacher checkpoint placed at a time on hosts that share this machine's files."""

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> Orchestrator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- launch -----------------------------------------------------------------------------
    def launch(self, spec: JobSpec, progress: Progress = _quiet,
               transfer: Transfer | None = None) -> JobRecord:
        """Provision every host, start every agent. All or nothing: on any failure, and on
        Ctrl-C (any exception) before every agent has started, whatever started is ended on
        every host and the job is recorded as FAILED (or CANCELLED)."""
        job = self.store.create_job(spec.name, spec.model_dump(mode="json"), spec.source)
        self.store.add_event(job.id, "launch", f"launching {spec.name}")
        return self._bring_up(job.id, spec, "launch", progress, transfer)

    def resume(self, ref: str, progress: Progress = _quiet,
               transfer: Transfer | None = None) -> JobRecord:
        """Start a STOPPED, FAILED, CANCELLED or LOST job again under the same id and CA:
        whatever of an earlier attempt still runs is ended first, certificates are renewed,
        every host is provisioned again (what is there is kept: checkpoints, logs) and every
        worker starts from its newest complete checkpoint. All or nothing, as `launch`."""
        job = self.store.get_job(ref)
        if job.state not in END_STATES:
            job = self.jobs.refresh(job.id).job
        if job.state == "SUCCEEDED":
            raise UsageError(f"job {job.id} SUCCEEDED: there is nothing to resume (launch its "
                             "spec again for a new run)")
        if job.state not in END_STATES:
            raise UsageError(f"job {job.id} is {job.state}: only a stopped, failed or cancelled "
                             f"job resumes (follow it: nebula logs -f {job.id}; end it: "
                             f"nebula stop {job.id})")
        spec = spec_of_record(job.spec, job.spec_path)
        self.jobs.stop(job.id, grace=0.0, force=True)  # nothing of an earlier attempt may linger
        note = self._check_checkpoints(spec, job.id)
        attempt = self.attempt(job.id) + 1
        self.store.reopen_job(job.id)
        self.store.add_event(job.id, RESUME_EVENT, f"resuming (attempt {attempt})")
        if note:
            progress(note)
        return self._bring_up(job.id, spec, "resume", progress, transfer)

    def _check_checkpoints(self, spec: JobSpec, job_id: str) -> str | None:
        """Before a resume: every host of a cluster must still hold checkpoints if one of
        them does (UsageError naming the hosts that lost theirs, nothing started); a note when
        a cluster has none (it starts from the beginning, and catches up from its peers)."""
        if spec.checkpoint is None:
            return None
        sites = self.facts.sites(spec)
        script = 'for f in "$0"/step*/COMPLETE; do [ -e "$f" ] && echo "$f"; done; true'

        def count(key: str) -> dict[str, tuple[int, str]]:
            """label -> (complete checkpoints, where) of the host (of a Slurm cluster: of
            each of its nodes, seen from its login node)."""
            cluster, host = next((c, h) for c in spec.clusters for h in c.hosts
                                 if worlds.site_key(c, h) == key)
            site = sites[key]
            places: list[HostSpec | int] = cluster.scheduling.checkpoint_places(cluster, host)
            out = {}
            for place in places:
                root = plan_model.job_root_of(site, job_id)
                where = checkpoint_paths.checkpoint_dir(spec, job_id, root, cluster, place)
                assert where is not None
                found = self.session.transport(site.conn).run(["/bin/sh", "-c", script, where],
                                                      timeout=60)
                out[checkpoint_paths.checkpoint_host(cluster, place)] = (len(found.stdout.split()),
                                                                where)
            return out

        found = fanout(list(sites), count, timeout=AGENT_TIMEOUT, cancel=self.session.abort)
        lost, fresh = [], []
        for c in spec.clusters:
            have = {label: v for h in c.hosts
                    for label, v in found[worlds.site_key(c, h)].items()}
            if all(n == 0 for n, _ in have.values()):
                fresh.append(c.name)
            else:
                lost += [f"{c.name}/{h}: no complete checkpoint in {where}"
                         for h, (n, where) in have.items() if n == 0]
        if lost:
            raise UsageError("cannot resume: hosts lost the checkpoints the rest of their "
                             "cluster holds (a cluster resumes from a step every host has):\n  "
                             + "\n  ".join(lost))
        if fresh:
            return (f"no checkpoint on {', '.join(fresh)}: "
                    + ("every cluster starts" if len(fresh) == len(spec.clusters) else
                       "those clusters start") + " from the beginning")
        return None

    def attempt(self, job_id: str) -> int:
        """Which attempt of the job this is (1 + the resumes so far)."""
        return 1 + self.store.count_events(job_id, RESUME_EVENT)

    def _bring_up(self, job_id: str, spec: JobSpec, action: str, progress: Progress,
                  transfer: Transfer | None) -> JobRecord:
        progress = _logged(progress, self.store.job_dir(job_id) / "launch.log")
        progress(f"job {job_id}" + (f" (attempt {self.attempt(job_id)})"
                                    if action == "resume" else ""))
        if (warning := spec.cleartext_warning()) is not None:
            progress(warning)
            self.store.add_event(job_id, "warning", warning)
        plan: JobPlan | None = None
        started: list[AgentPlan] = []
        try:  # a teacher's checkpoint first: no allocation waits idle while it downloads
            teachers = self._teacher_checkpoints(spec, job_id, action, progress)
            allocs = self._allocate(job_id, spec, progress, transfer)
            plan = self.facts.plan(allocations.expand(spec, allocs), job_id,
                             renew=action == "resume", conns=allocations.node_conns(allocs))
            for agent in plan.agents:  # recorded first: `stop` reaches hosts a launch touched
                self._record(job_id, agent, "PENDING")
            # hosts that upload first: the others see their files (a Slurm cluster's nodes)
            for hosts in ([a for a in plan.hosts if not a.files_from_first_host],
                          [a for a in plan.hosts if a.files_from_first_host]):
                fanout(hosts, lambda a: self._provision_host(spec, a, progress, transfer,
                                                             teachers.get(a.cluster)),
                       timeout=SETUP_TIMEOUT, cancel=self.session.abort)
            fanout(plan.agents, self._write_agent_files, timeout=AGENT_TIMEOUT,
                   cancel=self.session.abort)
            # relays first, so that workers find them; then workers
            for role in (plan_model.RELAY, plan_model.WORKER):
                results = fanout(plan.role(role), self._start, timeout=AGENT_TIMEOUT,
                                 cancel=self.session.abort)
                for agent, pid in results.items():
                    started.append(agent)
                    self._record(job_id, agent, "STARTING", pid=pid)
                    progress(f"started {agent.key} (agent pid {pid})")
        except BaseException as exc:
            cancelled = not isinstance(exc, Exception)  # Ctrl-C, SystemExit
            reason = "cancelled (interrupted)" if cancelled else _failure_reason(exc)
            self._abandon(job_id, plan, reason, "CANCELLED" if cancelled else "FAILED",
                          progress)
            if cancelled:
                raise
            spec_errors = [e for e in (exc.failures.values() if isinstance(exc, GroupError)
                                       else [exc]) if isinstance(e, SpecError)]
            if spec_errors:  # found only now (Slurm refused a request): exit 2, as validate
                raise spec_errors[0] from exc
            raise LaunchError(f"{action} of {job_id} failed; everything started was ended.\n"
                              f"{reason}") from exc
        self.store.set_job_state(job_id, "RUNNING")
        self.store.add_event(job_id, "running", f"{len(started)} agents started")
        return self.store.get_job(job_id)

    def _abandon(self, job_id: str, plan: JobPlan | None, reason: str, state: str,
                 progress: Progress) -> None:
        """End what a launch that did not finish started; record why. Bounded in time, and
        not cut short by another Ctrl-C."""
        with _sigint_deferred():
            with contextlib.suppress(Exception):
                progress(f"launch {state.lower()}: {reason}; ending what started")
            self.store.add_event(job_id, "launch-" + state.lower(), reason)
            if plan is not None:
                self._stop_agents(list(plan.agents), grace=0.0, force=True,
                                  timeout=CANCEL_STOP_TIMEOUT)
            with contextlib.suppress(Exception):  # what was submitted leaves the queue
                allocations.cancel_all(self.store.job_dir(job_id), self.session.transport, progress)
            if self.store.get_job(job_id).state not in END_STATES:  # not stopped meanwhile
                self.store.set_job_state(job_id, state, reason=reason)
            for rec in self.store.hosts(job_id):
                if rec.state not in END_STATES:  # its agent never started, or was just ended
                    rec.state = "STOPPED"
                    rec.detail["reason"] = f"not running: the launch was {state.lower()}"
                    self.store.upsert_host(rec)

    def _allocate(self, job_id: str, spec: JobSpec, progress: Progress,
                  transfer: Transfer | None) -> dict[str, Allocation]:
        """Each allocation (a Slurm cluster's batch job) asked for, then waited for (the job
        QUEUED, with the scheduler's reason, meanwhile) until every node answers. {} when no
        cluster's scheduler allocates."""
        clusters = {c.name: c for c in allocations.allocating_clusters(spec)}
        if not clusters:
            return {}
        home, job_dir = str(self.store.home), self.store.job_dir(job_id)

        def submit(name: str) -> Allocation:
            c = clusters[name]
            allocator = allocator_of(c)
            assert allocator is not None  # an allocating cluster's
            login = describe_host(c, c.hosts[0], home)
            t = self.session.transport(login)
            require_python(t, c.name, c.hosts[0].host)
            return allocator.submit(t, login, spec, c, job_id, lambda root: _upload_lib(
                t, root, _bar(transfer, f"{name}/{c.hosts[0].host}"), progress), progress)

        submitted = fanout(list(clusters), submit, timeout=SETUP_TIMEOUT, cancel=self.session.abort)
        allocations.record(job_dir, submitted)

        def queued(message: str) -> None:
            self.store.set_job_state(job_id, "QUEUED", reason=message)

        running = {n: allocator_named(a.scheduler).wait_running(  # here: the store, Ctrl-C
            self.session.transport(a.login), a, self.session.transport, progress, queued)
            for n, a in submitted.items()}
        allocations.record(job_dir, running)
        self.store.set_job_state(job_id, "PENDING", reason="")
        return running

    def _teacher_checkpoints(self, spec: JobSpec, job_id: str, action: str,
                             progress: Progress
                             ) -> dict[str, tuple[teacher_source.CheckpointSource, Path]]:
        """Each `teacher: {from_job:}` cluster's checkpoint, found and copied into the local
        cache (once per launch, before anything is allocated or provisioned) and recorded in
        the job's folder; a resume serves the recorded one (from the cache when it is there
        whole, without asking the earlier job's host)."""
        job_dir = self.store.job_dir(job_id)
        kept = teacher_source.recorded(job_dir) if action == "resume" else {}
        out = {}
        for c in teacher_source.sourced_teachers(spec):
            assert c.teacher is not None and c.teacher.from_job is not None
            source = kept.get(c.name)
            local = source and teacher_source.cached(source, self.store.home)
            if source is None or local is None:
                ref, cluster, step = ((source.job_id, source.cluster, source.step) if source
                                      else (c.teacher.from_job, c.teacher.from_cluster, None))
                source = teacher_source.find_source(self.store, self.session.transport, ref,
                                                    cluster, step)
                assert source.conn is not None
                local = teacher_source.fetch(source, self.session.transport(source.conn),
                                             self.store.home, progress)
            progress(f"{c.name}: serves {source.said()}")
            out[c.name] = (source, local)
        if out:
            teacher_source.record(job_dir, {name: s for name, (s, _) in out.items()})
        return out

    def _provision_host(self, spec: JobSpec, agent: AgentPlan, progress: Progress,
                        transfer: Transfer | None = None,
                        teacher: tuple[teacher_source.CheckpointSource, Path] | None = None
                        ) -> None:
        """Once per host: job dir, nebula_cli and the workdir uploaded (where the host does not
        share our files), a `from_job` teacher's checkpoint, the DeepSpeed config, setup, then
        `launchers/bootstrap.sh`."""
        t = self.session.transport(agent.conn)
        t.makedirs(agent.job_root, mode=0o700)
        where = f"{agent.cluster}/{agent.host}"
        bar = _bar(transfer, where)
        if agent.uploads:
            _upload_lib(t, agent.job_root, bar, progress)
        for local, remote in agent.uploads.items():
            n, size = t.upload_tree(local, remote, list(spec.exclude), bar("workdir"))
            progress(f"{where}: workdir uploaded ({n} files changed, {size} bytes)")
        if teacher is not None and not agent.files_from_first_host:  # (the first host's)
            # hosts that share this machine's files share one job folder: one copy, the others
            # see it; other hosts copy at once
            with self._placing if t.shares_files else contextlib.nullcontext():
                teacher_source.place(*teacher, t, agent.job_root, where, progress)
        ds = spec.deepspeed_config()
        if ds is not None:
            t.put_bytes(json.dumps(ds, indent=1).encode(),
                        posixpath.join(agent.job_root, "ds_config.json"))
        if spec.setup:
            progress(f"{where}: running setup")
            # marked like the agent's processes, so that stopping the agent sweeps it too
            env = {**helper_env(agent.config.processes[0].env),
                   "NEBULA_AGENT_DIR": agent.agent_dir}
            result = t.run(["/bin/sh", "-c", spec.setup], cwd=agent.config.cwd,
                           env=env, timeout=SETUP_TIMEOUT,
                           on_output=lambda line: progress(f"{where} setup | {line}"))
            if not result.ok:
                raise TransportError(f"setup failed: {result}", host=agent.host)
        # what the processes will import, found (after setup, which may install it)
        needs = ("nebula_cli.agent", *(("torch", "deepspeed") if spec.deepspeed else ()))
        bootstrap(t, where, needs, env=helper_env(
            agent.config.processes[0].env))

    def _write_agent_files(self, agent: AgentPlan) -> None:
        t = self.session.transport(agent.conn)
        t.makedirs(posixpath.join(agent.agent_dir, "logs"))
        for rel, data in agent.files.items():
            t.put_bytes(data, posixpath.join(agent.agent_dir, rel), mode=0o600)
        t.put_bytes(strict.dumps(agent.config), posixpath.join(agent.agent_dir, "agent.json"),
                    mode=0o600)

    def _start(self, agent: AgentPlan) -> int:
        t = self.session.transport(agent.conn)
        result = t.run_detached(self.session.agent_argv(agent.conn, "start", agent.agent_dir),
                                timeout=AGENT_TIMEOUT)
        try:
            reply = json.loads(result.stdout.strip().splitlines()[-1])
            return int(reply["agent_pid"])
        except (ValueError, KeyError, IndexError) as exc:
            raise TransportError(f"agent for {agent.key} did not start: {result}",
                                 host=agent.host) from exc

    def _record(self, job_id: str, agent: AgentPlan, state: str, pid: int | None = None) -> None:
        self.store.upsert_host(HostRecord(
            job_id=job_id, cluster=agent.cluster, host=agent.host, role=agent.role,
            node_rank=agent.node_rank, slots=agent.slots, agent_dir=agent.agent_dir,
            state=state, pid=pid,
            detail={"conn": agent.conn.to_data(), "logs": agent.logs,
                    "metrics": agent.metrics,
                    "tensorboard": agent.tensorboard,
                    ROTATED_KEY: agent.config.rotation.keep},
        ))

    def check_hosts(self, spec: JobSpec) -> list[HostCheck]:
        """Reach every host of the spec in parallel and report what each one has."""
        home = str(self.store.home)
        entries = {f"{c.name}/{h.host}": (c, h) for c in spec.clusters for h in c.hosts}

        def check(key: str) -> HostCheck:
            cluster, host = entries[key]
            try:
                t = self.session.transport(describe_host(cluster, host, home))
            except NebulaError as exc:
                return HostCheck(cluster.name, host.host, host.slots, error=str(exc))
            found = check_host(t, cluster.name, host.host, host.slots)
            found.interface = worlds.interface_of(cluster, host)  # the spec's, if it names one
            allocator = allocator_of(cluster)
            if allocator is not None and found.ok:  # a login node: the scheduler's tools,
                try:  # and what it would give the spec (nothing asked for)
                    allocator.check_host(t)
                    found.scheduler = allocator.preview(t, spec, cluster)
                except NebulaError as exc:  # a refusal: a SpecError at the spec's field
                    found.error = str(exc)
            return found

        checks = fanout(list(entries), check, timeout=120, cancel=self.session.abort)
        if all(c.ok for c in checks.values()):  # what the launch would choose
            for key, site in self.facts.routes(spec, self.facts.sites(spec)).items():
                checks[key].interface = worlds.interface_of(*entries[key], site)
        return list(checks.values())

    def read_on_gateway(self, cluster: ClusterSpec, path: str,
                        max_bytes: int = 16 << 20) -> bytes | None:
        """A file on the cluster's first host (None: not there); NebulaError when the host
        or the file cannot be read, or the file is larger than `max_bytes`."""
        t = self.session.transport(describe_host(cluster, cluster.gateway_host,
                                                 str(self.store.home)))
        data = t.read_file(path, max_bytes=max_bytes + 1)
        if data is not None and len(data) > max_bytes:
            raise TransportError(f"{cluster.gateway_host.host}: {path} is larger than "
                                 f"{max_bytes >> 20} MiB")
        return data

    def _stop_agents(self, agents: list[AgentPlan], grace: float, force: bool,
                     timeout: float) -> None:
        """End the agents of a launch that did not finish (best effort, every host tried,
        bounded in time)."""
        groups: dict[tuple[Any, ...], list[AgentPlan]] = defaultdict(list)
        for a in agents:
            groups[a.conn.machine_key()].append(a)

        def stop_group(key: tuple[Any, ...]) -> None:
            conn = groups[key][0].conn
            dirs = [a.agent_dir for a in groups[key]]
            args = ["stop", "--grace", str(grace)] + (["--force"] if force else [])
            self.session.transport(conn).run(self.session.agent_argv(conn, *args, *dirs),
                                             timeout=grace + timeout)

        # best effort: the launch error is what the user needs; every host is tried
        with contextlib.suppress(GroupError):
            fanout(list(groups), stop_group, timeout=grace + timeout, cancel=self.session.abort)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ctrl-C ignored meanwhile (main thread only): a cleanup cut short leaves processes
    behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _bar(transfer: Transfer | None, where: str
         ) -> Callable[[str], Callable[[int, int], None] | None]:
    """What an upload to `where` reports its progress through (per thing uploaded)."""
    def bar(what: str) -> Callable[[int, int], None] | None:
        if transfer is None:
            return None
        return lambda done, total: transfer(f"{where} {what}", done, total)

    return bar


def _upload_lib(t: Transport, job_root: str, bar: Callable[[str], Any],
                progress: Progress) -> None:
    """nebula_cli into the job's lib dir on the host (files already there are kept)."""
    lib = posixpath.join(plan_model.lib_dir(job_root), "nebula_cli")
    n, _ = t.upload_tree(str(PACKAGE_DIR), lib, ["__pycache__", "*.pyc"], bar("nebula_cli"))
    progress(f"{t.name}: nebula_cli uploaded ({n} files changed)")


def _logged(progress: Progress, path: Path) -> Progress:
    """`progress`, also appending each message to the job's launch.log (kept for later)."""
    lock = threading.Lock()

    def emit(message: str) -> None:
        with lock, open(path, "a") as fh:
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
        progress(message)

    return emit


def _failure_reason(exc: BaseException) -> str:
    if isinstance(exc, GroupError):
        return "\n".join(f"{k}: {v}" for k, v in exc.failures.items())
    return str(exc)
