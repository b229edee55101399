"""launch / status / stop / logs as plans carried out over transports, recorded in the store.

The orchestrator only talks to host agents (through `python -m nebula_cli.agent ...` run over a
transport); it never signals a worker itself.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_cli import pki
from nebula_cli.config import jobplan
from nebula_cli.config.jobplan import ProcessPlan
from nebula_cli.config.spec import ClusterSpec, HostSpec, JobSpec
from nebula_cli.control.fanout import GroupError, fanout
from nebula_cli.control.follow import LogFollower, MetricsFollower
from nebula_cli.control.hostcheck import HostCheck, check_host
from nebula_cli.control.state import ACTIVE_STATES, END_STATES, HostRecord, JobRecord, StateStore
from nebula_cli.errors import LaunchError, NebulaError, TransportError
from nebula_cli.transport import Transport, connect, machine_key

SETUP_TIMEOUT = 3600.0
PACKAGE_DIR = Path(__file__).resolve().parent.parent
FREE_PORT_PY = (
    "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1]); s.close()"
)
AGENT_TIMEOUT = 60.0

Progress = Callable[[str], None]
Transfer = Callable[[str, int, int], None]  # (what, bytes done, bytes in all)


def _quiet(_: str) -> None:
    pass


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


def job_state(hosts: list[HostRecord], current: str) -> str:
    """The job's state from its agents' states. Relays serve the workers: once the workers
    are done, relays ended by nebula do not make the job STOPPED."""
    states = {h.state for h in hosts}
    if not hosts:
        return current
    if states & ACTIVE_STATES:
        return "RUNNING"
    if states & {"FAILED", "LOST"}:
        return "FAILED"
    workers = {h.state for h in hosts if h.role == jobplan.WORKER} or states
    if "STOPPED" in workers:
        return "STOPPED"
    return "SUCCEEDED"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Orchestrator:
    """Carries out commands on a job's hosts. Close it to release its connections."""

    def __init__(self, store: StateStore, *, accept_new_host_keys: bool = False) -> None:
        self.store = store
        self.accept_new_host_keys = accept_new_host_keys
        self._transports: dict[tuple[Any, ...], Transport] = {}

    # -- connections ------------------------------------------------------------------------
    def transport(self, conn: dict[str, Any]) -> Transport:
        key = machine_key(conn)
        if key not in self._transports:
            self._transports[key] = connect(
                conn, accept_new_host_keys=self.accept_new_host_keys)
        return self._transports[key]

    def transport_of(self, rec: HostRecord) -> Transport:
        return self.transport(rec.detail["conn"])

    def close(self) -> None:
        for t in self._transports.values():
            t.close()
        self._transports.clear()

    def __enter__(self) -> Orchestrator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _agent(self, conn: dict[str, Any], *args: str) -> list[str]:
        """The agent command line; on remote hosts nebula_cli comes from the job's lib dir."""
        argv = [conn["python"], "-m", "nebula_cli.agent", *args]
        if conn.get("pythonpath"):
            return ["env", f"PYTHONPATH={conn['pythonpath']}", *argv]
        return argv

    # -- launch -----------------------------------------------------------------------------
    def launch(self, spec: JobSpec, progress: Progress = _quiet,
               transfer: Transfer | None = None) -> JobRecord:
        """Provision every host, start every agent; on any failure end what started."""
        job = self.store.create_job(spec.name, spec.model_dump(mode="json"), spec.source)
        self.store.add_event(job.id, "launch", f"launching {spec.name}")
        progress = _logged(progress, self.store.job_dir(job.id) / "launch.log")
        progress(f"job {job.id}")
        plans: list[ProcessPlan] = []
        started: list[ProcessPlan] = []
        try:
            plans = self.plan(spec, job.id)
            for plan in plans:  # recorded first: `stop` reaches hosts a failed launch touched
                self._record(job.id, plan, "PENDING")
            hosts = {(p.cluster, p.host): p for p in plans if p.role == jobplan.WORKER}
            fanout(list(hosts.values()),
                   lambda p: self._provision_host(spec, p, progress, transfer),
                   timeout=SETUP_TIMEOUT)
            fanout(plans, self._write_agent_files, timeout=AGENT_TIMEOUT)
            # relays first, so that workers find them; then workers
            for role in (jobplan.RELAY, jobplan.WORKER):
                batch = [p for p in plans if p.role == role]
                results = fanout(batch, self._start, timeout=AGENT_TIMEOUT)
                for plan, pid in results.items():
                    started.append(plan)
                    self._record(job.id, plan, "STARTING", pid=pid)
                    progress(f"started {plan.key} (agent pid {pid})")
        except NebulaError as exc:
            reason = _failure_reason(exc)
            progress(f"launch failed: {reason}")
            self.store.add_event(job.id, "launch-failed", reason)
            self._stop_plans(plans, grace=0.0, force=True)
            self.store.set_job_state(job.id, "FAILED", reason=reason)
            for rec in self.refresh(job.id).hosts:
                if rec.state == "PENDING":  # its agent never started
                    rec.state = "STOPPED"
                    rec.detail["reason"] = "not started: the launch failed"
                    self.store.upsert_host(rec)
            raise LaunchError(f"launch of {job.id} failed; everything started was ended.\n"
                              f"{reason}") from exc
        self.store.set_job_state(job.id, "RUNNING")
        self.store.add_event(job.id, "running", f"{len(started)} agents started")
        return self.store.get_job(job.id)

    def sites(self, spec: JobSpec) -> dict[str, jobplan.Site]:
        """Every host's nebula directory and address (connecting to remote hosts to learn it)."""
        home = str(self.store.home)
        entries = {f"{c.name}/{h.host}": (c, h) for c in spec.clusters for h in c.hosts}

        def site(key: str) -> jobplan.Site:
            cluster, host = entries[key]
            if cluster.transport == "local":
                return jobplan.Site(home, host.address or "127.0.0.1")
            t = self.transport(jobplan.connection_of(cluster, host, home))
            target = getattr(t, "target", None)  # ssh: the HostName that ssh_config resolved
            return jobplan.Site(t.home, host.address or getattr(target, "hostname", host.host))

        return fanout(list(entries), site, timeout=AGENT_TIMEOUT)

    def _master_port(self, cluster: ClusterSpec, host: HostSpec, home: str) -> int:
        """A free port on `host` (where a world's rank 0 runs) for DeepSpeed's rendezvous."""
        if cluster.transport == "local":
            return free_port()
        t = self.transport(jobplan.connection_of(cluster, host, home))
        result = t.run([t.python, "-c", FREE_PORT_PY], timeout=AGENT_TIMEOUT)
        try:
            return int(result.stdout.strip())
        except ValueError as exc:
            raise TransportError(f"cannot find a free port: {result}", host=host.host) from exc


    def plan(self, spec: JobSpec, job_id: str) -> list[ProcessPlan]:
        """Every agent to start, with its config and files (certificates, relay.json)."""
        home = str(self.store.home)
        sites = self.sites(spec)
        master_ports = {world: self._master_port(c, h, home)
                        for world, (c, h) in jobplan.rendezvous_hosts(spec).items()}
        workers = jobplan.plan_workers(spec, job_id, sites=sites, local_home=home,
                                       master_ports=master_ports)
        relays = jobplan.plan_relays(spec, job_id, sites=sites, local_home=home)
        if not relays or spec.relay is None:
            return workers
        relay = spec.relay
        ports = {  # clusters on this machine cannot share ports
            c.name: (free_port(), free_port()) if c.transport == "local"
            else (relay.port, relay.effective_worker_port)
            for c in spec.clusters
        }
        issued = pki.issue_job_pki(
            job_id, {c.name: [h.host for h in c.hosts] for c in spec.clusters},
            self.store.job_dir(job_id) / "pki",
        )
        ca = issued.ca_cert.read_bytes()
        clusters = {c.name: c for c in spec.clusters}
        relay_hosts = {}
        for rp in relays:
            pair = issued.relay(rp.cluster)
            config = jobplan.relay_config(spec, job_id, clusters[rp.cluster], rp.agent_dir,
                                          ports, sites)
            relay_hosts[rp.cluster] = sites[f"{rp.cluster}/{rp.host}"].address
            rp.files = {
                "relay.json": json.dumps(config, indent=1).encode(),
                "certs/ca.pem": ca, "certs/relay.pem": pair.cert.read_bytes(),
                "certs/relay.key": pair.key.read_bytes(),
            }
        for wp in workers:
            pair = issued.worker(wp.cluster, wp.host)
            env = jobplan.relay_worker_env(spec, clusters[wp.cluster], ports[wp.cluster][1],
                                           posixpath.join(wp.agent_dir, "certs"),
                                           relay_hosts[wp.cluster])
            for proc in wp.agent_config["processes"]:
                proc["env"].update(env)
            wp.files = {"certs/ca.pem": ca, "certs/worker.pem": pair.cert.read_bytes(),
                        "certs/worker.key": pair.key.read_bytes()}
        return relays + workers

    def _provision_host(self, spec: JobSpec, plan: ProcessPlan, progress: Progress,
                        transfer: Transfer | None = None) -> None:
        """Once per host: job dir, nebula_cli and the workdir uploaded (remote hosts), setup."""
        t = self.transport(plan.conn)
        t.makedirs(plan.job_root)
        if plan.conn["transport"] != "local":
            sync_dir = getattr(t, "sync_dir", None)
            if sync_dir is None:
                raise TransportError("this transport cannot upload directories", host=plan.host)
            where = f"{plan.cluster}/{plan.host}"

            def bar(what: str) -> Callable[[int, int], None] | None:
                if transfer is None:
                    return None
                return lambda done, total: transfer(f"{where} {what}", done, total)

            lib = posixpath.join(jobplan.lib_dir(plan.job_root), "nebula_cli")
            n, size = sync_dir(str(PACKAGE_DIR), lib, ["__pycache__", "*.pyc"], bar("nebula_cli"))
            progress(f"{where}: nebula_cli uploaded ({n} files changed)")
            n, size = sync_dir(spec.workdir, plan.agent_config["cwd"], list(spec.exclude),
                               bar("workdir"))
            progress(f"{where}: workdir uploaded ({n} files changed, {size} bytes)")
        ds = spec.deepspeed_config()
        if ds is not None:
            t.put_bytes(json.dumps(ds, indent=1).encode(),
                        posixpath.join(plan.job_root, "ds_config.json"))
        if spec.setup:
            where = f"{plan.cluster}/{plan.host}"
            progress(f"{where}: running setup")
            # marked like the agent's processes, so that stopping the agent sweeps it too
            env = {**plan.agent_config["processes"][0]["env"], "NEBULA_AGENT_DIR": plan.agent_dir}
            result = t.run(["/bin/sh", "-c", spec.setup], cwd=plan.agent_config["cwd"],
                           env=env, timeout=SETUP_TIMEOUT,
                           on_output=lambda line: progress(f"{where} setup | {line}"))
            if not result.ok:
                raise TransportError(f"setup failed: {result}", host=plan.host)

    def _write_agent_files(self, plan: ProcessPlan) -> None:
        t = self.transport(plan.conn)
        t.makedirs(posixpath.join(plan.agent_dir, "logs"))
        for rel, data in plan.files.items():
            t.put_bytes(data, posixpath.join(plan.agent_dir, rel), mode=0o600)
        t.put_bytes(json.dumps(plan.agent_config, indent=1).encode(),
                    posixpath.join(plan.agent_dir, "agent.json"), mode=0o600)

    def _start(self, plan: ProcessPlan) -> int:
        t = self.transport(plan.conn)
        result = t.run(self._agent(plan.conn, "start", plan.agent_dir), timeout=AGENT_TIMEOUT)
        try:
            reply = json.loads(result.stdout.strip().splitlines()[-1])
            return int(reply["agent_pid"])
        except (ValueError, KeyError, IndexError) as exc:
            raise TransportError(f"agent for {plan.key} did not start: {result}",
                                 host=plan.host) from exc

    def _record(self, job_id: str, plan: ProcessPlan, state: str, pid: int | None = None) -> None:
        self.store.upsert_host(HostRecord(
            job_id=job_id, cluster=plan.cluster, host=plan.host, role=plan.role,
            node_rank=plan.node_rank, slots=plan.slots, agent_dir=plan.agent_dir, state=state,
            pid=pid, detail={"conn": plan.conn, "logs": plan.logs, "metrics": plan.metrics},
        ))

    def check_hosts(self, spec: JobSpec) -> list[HostCheck]:
        """Reach every host of the spec in parallel and report what each one has."""
        home = str(self.store.home)
        entries = {f"{c.name}/{h.host}": (c, h) for c in spec.clusters for h in c.hosts}

        def check(key: str) -> HostCheck:
            cluster, host = entries[key]
            try:
                t = self.transport(jobplan.connection_of(cluster, host, home))
            except NebulaError as exc:
                return HostCheck(cluster.name, host.host, host.slots, error=str(exc))
            return check_host(t, cluster.name, host.host, host.slots)

        return list(fanout(list(entries), check, timeout=120).values())

    # -- status -----------------------------------------------------------------------------
    def _by_machine(self, hosts: list[HostRecord]) -> dict[tuple[Any, ...], list[HostRecord]]:
        groups: dict[tuple[Any, ...], list[HostRecord]] = defaultdict(list)
        for rec in hosts:
            groups[machine_key(rec.detail["conn"])].append(rec)
        return groups

    def _agent_call(self, recs: list[HostRecord], *args: str, timeout: float) -> list[dict]:
        conn = recs[0].detail["conn"]
        result = self.transport(conn).run(
            self._agent(conn, *args, *[r.agent_dir for r in recs]), timeout=timeout
        )
        try:
            replies = json.loads(result.stdout)
        except json.JSONDecodeError as exc:
            raise TransportError(f"agent did not answer: {result}", host=conn["name"]) from exc
        if not isinstance(replies, list) or len(replies) != len(recs):
            raise TransportError(f"agent gave an unexpected answer: {result}", host=conn["name"])
        return replies

    def refresh(self, ref: str) -> JobSnapshot:
        """Ask every agent of an unfinished job for its state; record changes; derive the job's."""
        job = self.store.get_job(ref)
        hosts = self.store.hosts(job.id)
        live = [h for h in hosts if h.state not in END_STATES]
        if live:
            groups = self._by_machine(live)
            try:
                answers = fanout(
                    list(groups), lambda k: self._agent_call(groups[k], "status", timeout=30),
                    timeout=60,
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
            if job.state != "PENDING" and self._end_idle_relays(hosts):
                hosts = self.store.hosts(job.id)
        if job.state == "RUNNING":  # launching (PENDING) and ended jobs keep their state
            state = job_state(hosts, job.state)
            if state != job.state:
                failed = [h for h in hosts if h.state in ("FAILED", "LOST")]
                reason = "; ".join(
                    f"{h.cluster}/{h.host} {h.role}: {h.detail.get('reason') or h.state}"
                    for h in failed
                ) or None
                ends = [h.detail.get("ended") for h in hosts if h.role == jobplan.WORKER]
                at = max(ends) if ends and all(ends) and state in END_STATES else None
                self.store.set_job_state(job.id, state, reason=reason, at=at)
                self.store.add_event(job.id, "state", f"job {state.lower()}")
                job = self.store.get_job(job.id)
        return JobSnapshot(job=job, hosts=hosts)

    def _end_idle_relays(self, hosts: list[HostRecord]) -> bool:
        """Once every worker has ended, the relays have nothing left to do: end them."""
        workers = [h for h in hosts if h.role == jobplan.WORKER]
        relays = [h for h in hosts if h.role == jobplan.RELAY and h.state not in END_STATES]
        if not relays or not workers or any(w.state not in END_STATES for w in workers):
            return False
        groups = self._by_machine(relays)
        try:
            answers = fanout(list(groups), lambda k: self._agent_call(
                groups[k], "stop", "--grace", "5", timeout=60), timeout=90)
        except GroupError as exc:
            answers = {k: v for k, v in exc.results.items() if isinstance(v, list)}
        for key, replies in answers.items():
            for rec, reply in zip(groups[key], replies, strict=True):
                reply["reason"] = "ended after the workers finished"
                self._apply_status(rec, reply)
        return True

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
        })
        rec.detail.pop("unreachable", None)
        self.store.upsert_host(rec)
        if changed:
            why = f" ({rec.detail['reason']})" if rec.detail.get("reason") else ""
            self.store.add_event(rec.job_id, "host-state", f"{rec.role} {state.lower()}{why}",
                                 cluster=rec.cluster, host=rec.host)

    # -- stop -------------------------------------------------------------------------------
    def stop(self, ref: str, *, grace: float = 10.0, force: bool = False) -> StopReport:
        """End every process group of the job on every host. Ending an ended job is fine."""
        snap = self.refresh(ref)
        report = StopReport(job=snap.job)
        groups = self._by_machine(snap.hosts)
        args = ["stop", "--grace", str(grace)] + (["--force"] if force else [])
        self.store.add_event(snap.job.id, "stop", f"stop requested (grace {grace:g} s)")
        failures: dict[object, object] = {}
        try:
            answers = fanout(
                list(groups),
                lambda k: self._agent_call(groups[k], *args, timeout=grace + 60),
                timeout=grace + 90,
            )
        except GroupError as exc:
            answers = {k: v for k, v in exc.results.items() if isinstance(v, list)}
            failures = dict(exc.failures)
        for key, replies in answers.items():
            for rec, reply in zip(groups[key], replies, strict=True):
                was_active = rec.state not in END_STATES
                self._apply_status(rec, reply)
                report.swept += len(reply.get("swept") or [])
                (report.stopped if was_active else report.already_ended).append(rec)
        hosts = self.store.hosts(snap.job.id)
        if snap.job.state not in END_STATES or report.stopped:
            final = "STOPPED" if not any(h.state in ("FAILED", "LOST") for h in report.stopped) \
                else "FAILED"
            self.store.set_job_state(snap.job.id, final if report.stopped else
                                     job_state(hosts, snap.job.state))
        report.job = self.store.get_job(snap.job.id)
        if failures:
            def label(key: object) -> str:
                return ", ".join(sorted({f"{r.cluster}/{r.host}" for r in groups[key]}))  # type: ignore[index]

            raise GroupError({**{label(k): "stopped" for k in answers},
                              **{label(k): v for k, v in failures.items()}})
        return report

    def _stop_plans(self, plans: list[ProcessPlan], grace: float, force: bool) -> None:
        """End the agents of a launch that did not finish (best effort, every host tried)."""
        groups: dict[tuple[Any, ...], list[ProcessPlan]] = defaultdict(list)
        for p in plans:
            groups[machine_key(p.conn)].append(p)

        def stop_group(key: tuple[Any, ...]) -> None:
            conn = groups[key][0].conn
            dirs = [p.agent_dir for p in groups[key]]
            args = ["stop", "--grace", str(grace)] + (["--force"] if force else [])
            self.transport(conn).run(self._agent(conn, *args, *dirs), timeout=grace + 60)

        # best effort: the launch error is what the user needs; every host is tried
        with contextlib.suppress(GroupError):
            fanout(list(groups), stop_group, timeout=grace + 90)

    # -- logs and metrics -------------------------------------------------------------------
    def follow_logs(self, ref: str, **filters: Any) -> LogFollower:
        job = self.store.get_job(ref)
        return LogFollower(self.store.hosts(job.id), self.transport_of, **filters)

    def follow_metrics(self, ref: str) -> MetricsFollower:
        job = self.store.get_job(ref)
        return MetricsFollower(self.store.hosts(job.id), self.transport_of)


def _logged(progress: Progress, path: Path) -> Progress:
    """`progress`, also appending each message to the job's launch.log (kept for later)."""
    lock = threading.Lock()

    def emit(message: str) -> None:
        with lock, open(path, "a") as fh:
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
        progress(message)

    return emit


def _failure_reason(exc: NebulaError) -> str:
    if isinstance(exc, GroupError):
        return "\n".join(f"{k}: {v}" for k, v in exc.failures.items())
    return str(exc)
