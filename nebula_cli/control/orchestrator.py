"""launch: a spec turned into a plan and carried out over transports, recorded in the store.

The orchestrator only talks to host agents (through `python -m nebula_cli.agent ...` run over a
transport); it never signals a worker itself. Status, stop and logs live in `jobs`.
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
from pathlib import Path
from typing import Any

from nebula_cli import pki
from nebula_cli.config import jobplan
from nebula_cli.config.jobplan import ProcessPlan
from nebula_cli.config.spec import ClusterSpec, HostSpec, JobSpec
from nebula_cli.control.fanout import GroupError, fanout
from nebula_cli.control.hostcheck import HostCheck, check_host
from nebula_cli.control.jobs import JobOps, JobSnapshot, StopReport, job_state
from nebula_cli.control.state import HostRecord, JobRecord
from nebula_cli.errors import LaunchError, NebulaError, TransportError
from nebula_cli.transport import machine_key

__all__ = ["JobSnapshot", "Orchestrator", "StopReport", "job_state"]

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Orchestrator(JobOps):
    """Carries out commands on a job's hosts. Close it to release its connections."""

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
