"""From a JobSpec to a typed, frozen JobPlan: which host runs which agent, with which processes,
ranks, environment and files (the relay's relay.json, the workers' sync.json, certificates).

`build_plan(spec, job_id, sites, ports, certs)` is one pure function: the spec says what is
wanted, `sites` what the transports report about each host (its nebula directory, the address
its peers use, where its services bind, its python, whether it sees this machine's files),
`ports` the ports found free, `certs` the job's PKI. Nothing patches the plan afterwards; the
control plane only carries it out. Every value in it comes from the spec's model, where the
defaults live.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_cli.config import strict
from nebula_cli.config.checkpoint_paths import checkpoint_dir as checkpoint_dir
from nebula_cli.config.checkpoint_paths import checkpoint_host as checkpoint_host
from nebula_cli.config.checkpoint_paths import (
    checkpoint_settings as checkpoint_settings,
)
from nebula_cli.config.metrics_plan import METRICS_FILE, metrics_config
from nebula_cli.config.parts import (
    METRICS_CONFIG_ENV,
    SYNC_CONFIG_ENV,
    AgentConfig,
    CheckpointSettings,
    ProcessConfig,
    SyncConfig,
)
from nebula_cli.config.pipeline import device_id
from nebula_cli.config.relay_config import AutoSteps, RelayConfig, ShapingConfig, TlsFiles
from nebula_cli.config.spec import ClusterSpec, HostSpec, JobSpec
from nebula_cli.config.worlds import PIPELINE_WORLD as PIPELINE_WORLD
from nebula_cli.config.worlds import interface_of as interface_of
from nebula_cli.config.worlds import pipeline_env as pipeline_env
from nebula_cli.config.worlds import rendezvous_hosts as rendezvous_hosts
from nebula_cli.config.worlds import route_targets as route_targets
from nebula_cli.config.worlds import site_key as site_key
from nebula_cli.config.worlds import world_env as world_env
from nebula_cli.config.worlds import world_of as world_of

WORKER = "worker"
RELAY = "relay"
RELAY_RESTARTS = 3
"""A relay is restarted this often at least: a cluster whose relay died rejoins and catches up."""
RELAY_GRACE = 5.0
"""Seconds a relay gets between SIGTERM and SIGKILL (it has no state worth saving)."""
RELAY_RESTART_BACKOFF = 1.0
WORKER_RESTART_BACKOFF = 5.0
RUNTIME_HOOK_DIR = ("runtime", "autohook")
"""Inside the nebula_cli package: the directory (only a sitecustomize) that a worker's
PYTHONPATH starts with when the spec's runtime.auto is on (the automatic runtime hook)."""
WORKER_SOCKET = "worker.sock"
"""The relay's Unix socket for workers on its own host, in the relay's directory."""


@dataclass(frozen=True)
class Site:
    """What a host's transport reports about it (see `Transport`)."""

    conn: dict[str, Any]
    """How to reach the host (`transport.describe`); kept in the state store."""
    home: str
    """Absolute path of nebula's directory on the host (jobs live in home/jobs)."""
    address: str
    """The address other hosts use for this one."""
    bind: str
    """The address services on this host listen on."""
    python: str
    """The interpreter processes run under."""
    shares_files: bool
    """The host sees this machine's files at the same paths: the workdir is used in place."""
    interface: str | None = None
    """The interface the host reaches the rest of its DeepSpeed world through (asked of hosts
    of multi-host worlds whose spec names none: see `route_targets`); GLOO/NCCL_SOCKET_IFNAME."""


@dataclass(frozen=True)
class Ports:
    """Ports found free on the hosts that listen."""

    masters: dict[str, int]
    """DeepSpeed world (a cluster's name, or PIPELINE_WORLD) -> rendezvous port of its rank 0."""
    relays: dict[str, tuple[int, int]]
    """cluster -> (peer port, worker port) of its relay."""


@dataclass(frozen=True)
class Certs:
    """The job's PEM files, as bytes: the CA certificate and one pair per relay and host."""

    ca: bytes
    relays: dict[str, tuple[bytes, bytes]]
    """cluster -> (certificate, key) of its relay."""
    workers: dict[str, tuple[bytes, bytes]]
    """"cluster/host" -> (certificate, key) of that host's workers."""


@dataclass(frozen=True, eq=False)
class AgentPlan:
    """One agent to start: a role (worker or relay) on one host of one cluster (hashed by
    identity: fan-outs key their results by it)."""

    cluster: str
    host: str
    role: str
    node_rank: int
    slots: int
    conn: dict[str, Any]
    job_root: str
    """The job's directory on that host."""
    config: AgentConfig
    files: dict[str, bytes] = field(default_factory=dict)
    """Files to write beside agent.json (mode 0600), relative to the agent's directory."""
    uploads: dict[str, str] = field(default_factory=dict)
    """Local directory -> where it goes on the host (empty when the host shares our files)."""
    tensorboard: str | None = None
    """Where this host writes its cluster's TensorBoard run (spec: metrics.tensorboard)."""

    @property
    def agent_dir(self) -> str:
        return agent_dir(self.job_root, self.cluster, self.host, self.role)

    @property
    def key(self) -> str:
        return f"{self.cluster}/{self.host}/{self.role}"

    def __str__(self) -> str:
        return self.key

    @property
    def logs(self) -> dict[str, str]:
        """rank (or role name) -> log path relative to the agent dir."""
        return {p.name: p.log for p in self.config.processes}

    @property
    def metrics(self) -> dict[str, str]:
        """rank (or role name) -> metrics path relative to the agent dir."""
        return {p.name: p.metrics for p in self.config.processes if p.metrics}


@dataclass(frozen=True)
class JobPlan:
    """Every agent of a job, relays first (workers find them running)."""

    job_id: str
    agents: tuple[AgentPlan, ...]

    def role(self, role: str) -> list[AgentPlan]:
        return [a for a in self.agents if a.role == role]

    @property
    def hosts(self) -> list[AgentPlan]:
        """One agent per host that runs workers: where provisioning happens."""
        return self.role(WORKER)


def agent_dir(job_root: str, cluster: str, host: str, role: str) -> str:
    return posixpath.join(job_root, cluster, host, role)


def cert_names(role: str) -> tuple[str, str, str]:
    """Where a role's PEM files go, relative to its agent dir: the job's CA certificate, the
    role's certificate and key (the plan writes them there; its TLS paths point there)."""
    return "certs/ca.pem", f"certs/{role}.pem", f"certs/{role}.key"


def _tls(adir: str, role: str) -> TlsFiles:
    ca, cert, key = (posixpath.join(adir, name) for name in cert_names(role))
    return TlsFiles(ca=ca, cert=cert, key=key)


def lib_dir(job_root: str) -> str:
    """Where the nebula_cli package is uploaded on a host that does not share our files."""
    return posixpath.join(job_root, "lib")


def _conn(site: Site, job_root: str) -> dict[str, Any]:
    """The site's connection, with where nebula_cli lives when it is uploaded."""
    if site.shares_files:
        return dict(site.conn)
    return {**site.conn, "pythonpath": lib_dir(job_root)}


def base_env(site: Site, job_root: str) -> dict[str, str]:
    """So that `python` in a command is the site's, and nebula_cli is importable there; a
    process that dies in native code (SIGSEGV, SIGABRT) leaves every thread's Python stack in
    its log (the spec's `env` can say otherwise)."""
    env: dict[str, str] = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    if posixpath.isabs(site.python):  # the agent puts it first on PATH
        env["NEBULA_PATH_PREPEND"] = posixpath.dirname(site.python)
    if not site.shares_files:
        env["PYTHONPATH"] = lib_dir(job_root)
    return env


def runtime_hook_dir(site: Site, job_root: str) -> str:
    """Where the automatic hook's sitecustomize is on the host: in the package this machine
    runs (a host that shares our files), else in the uploaded copy under the job's lib."""
    if site.shares_files:
        return str(Path(__file__).resolve().parent.parent.joinpath(*RUNTIME_HOOK_DIR))
    return posixpath.join(lib_dir(job_root), "nebula_cli", *RUNTIME_HOOK_DIR)


def with_runtime_hook(env: dict[str, str], site: Site, job_root: str) -> dict[str, str]:
    """`env` with the automatic hook's directory first on PYTHONPATH (what was there kept)."""
    parts = [runtime_hook_dir(site, job_root)]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    return {**env, "PYTHONPATH": ":".join(parts)}


def without_runtime_hook(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process that is not a training process (the setup command): the hook's
    directory left off PYTHONPATH."""
    hook = posixpath.join(*RUNTIME_HOOK_DIR)
    parts = [p for p in env.get("PYTHONPATH", "").split(":") if p and not p.endswith(hook)]
    out = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    if parts:
        out["PYTHONPATH"] = ":".join(parts)
    return out


def build_plan(spec: JobSpec, job_id: str, *, sites: dict[str, Site], ports: Ports,
               certs: Certs | None) -> JobPlan:
    """The whole plan of a job (pure). `certs` is required when the spec has a relay."""
    relays = _relay_agents(spec, job_id, sites, ports, certs)
    workers = _worker_agents(spec, job_id, sites, ports, certs)
    return JobPlan(job_id=job_id, agents=tuple(relays + workers))


def _worker_agents(spec: JobSpec, job_id: str, sites: dict[str, Site], ports: Ports,
                   certs: Certs | None) -> list[AgentPlan]:
    """One worker agent per host: `slots` processes each running `spec.run` in the workdir.

    Data parallel: one world per cluster, ranks in host order. Pipeline: one world over every
    cluster, ranks from the pipeline layout."""
    plans = []
    layout = spec.pipeline_layout()
    masters = {world: sites[site_key(c, h)].address
               for world, (c, h) in rendezvous_hosts(spec).items()}
    host_index = 0  # across the clusters: CROSS_RANK of a pipelined world
    for ci, cluster in enumerate(spec.clusters):
        rank = 0
        world = world_of(spec, cluster)
        for node_rank, host in enumerate(cluster.hosts):
            site = sites[site_key(cluster, host)]
            job_root = job_root_of(site, job_id)
            adir = agent_dir(job_root, cluster.name, host.host, WORKER)
            cwd = spec.workdir if site.shares_files else posixpath.join(job_root, "work")
            env = {**spec.env, **cluster.env, **base_env(site, job_root)}
            env.update(world_env(spec, job_id, ci, node_rank, ports.masters[world],
                                  masters[world], interface_of(cluster, host, site)))
            if layout is not None:
                env.update(pipeline_env(spec, layout.world_size, layout.num_stages),
                           CROSS_RANK=str(host_index))
            host_index += 1
            if spec.runtime.auto:
                env = with_runtime_hook(env, site, job_root)
            if spec.deepspeed is not None:
                env["NEBULA_DS_CONFIG"] = posixpath.join(job_root, "ds_config.json")
            files: dict[str, bytes] = {}
            if spec.relay is not None:
                assert certs is not None  # build_plan's contract
                sync = sync_config(spec, job_id, cluster, adir,
                                   relay_addr=_relay_addr(spec, cluster, sites, ports),
                                   relay_socket=relay_socket(job_root, cluster, host),
                                   checkpoint=checkpoint_settings(spec, job_id, job_root,
                                                                  cluster, host))
                env[SYNC_CONFIG_ENV] = posixpath.join(adir, "sync.json")
                cert, key = certs.workers[site_key(cluster, host)]
                files = {"sync.json": strict.dumps(sync),
                         **dict(zip(cert_names(WORKER), (certs.ca, cert, key), strict=True))}
            sinks = metrics_config(spec, job_id, cluster, node_rank, adir)
            if sinks is not None:
                files[METRICS_FILE] = strict.dumps(sinks)
            processes = []
            for local_rank in range(host.slots):
                device = device_id(cluster.name, host.host, local_rank)
                proc_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(local_rank),
                            "NEBULA_DEVICE": device}
                if layout is not None:
                    stage, replica = layout.position(device)
                    proc_env.update(RANK=str(layout.rank_of(device)), NEBULA_STAGE=str(stage),
                                    NEBULA_REPLICA=str(replica))
                name = proc_env["RANK"]
                proc_env["NEBULA_METRICS_FILE"] = posixpath.join(
                    adir, "metrics", f"rank{name}.jsonl")
                if sinks is not None and local_rank == 0:  # the cluster's writer
                    proc_env[METRICS_CONFIG_ENV] = posixpath.join(adir, METRICS_FILE)
                processes.append(ProcessConfig(
                    name=name, argv=["/bin/sh", "-c", spec.run], env=proc_env,
                    log=f"logs/rank{name}.log", metrics=f"metrics/rank{name}.jsonl"))
                rank += 1
            config = AgentConfig(
                job_id=job_id, cluster=cluster.name, host=host.host, role=WORKER, cwd=cwd,
                grace=spec.grace, max_restarts=spec.max_restarts
                if cluster.max_restarts is None else cluster.max_restarts,
                restart_backoff=WORKER_RESTART_BACKOFF, processes=processes)
            # a Slurm cluster's nodes share one file system: its first node uploads
            shared = cluster.scheduler == "slurm" and node_rank > 0
            uploads = {} if site.shares_files or shared else {spec.workdir: cwd}
            plans.append(AgentPlan(
                cluster=cluster.name, host=host.host, role=WORKER, node_rank=node_rank,
                slots=host.slots, conn=_conn(site, job_root), job_root=job_root,
                config=config, files=files, uploads=uploads,
                tensorboard=sinks.tensorboard_dir if sinks is not None else None))
    return plans


def _gateway_site(cluster: ClusterSpec, sites: dict[str, Site]) -> Site:
    return sites[site_key(cluster, cluster.gateway_host)]


def _relay_addr(spec: JobSpec, cluster: ClusterSpec, sites: dict[str, Site],
                ports: Ports) -> str:
    """host:port where the cluster's workers reach their relay."""
    return f"{_gateway_site(cluster, sites).address}:{ports.relays[cluster.name][1]}"


def relay_socket(job_root: str, cluster: ClusterSpec, host: HostSpec) -> str | None:
    """The Unix socket where workers on `host` reach their relay without TLS when `host` runs
    it (the cluster's gateway; `job_root`: the job's directory there), else None."""
    gateway = cluster.gateway_host.host
    return (posixpath.join(agent_dir(job_root, cluster.name, gateway, RELAY), WORKER_SOCKET)
            if host.host == gateway else None)


def job_root_of(site: Site, job_id: str) -> str:
    """The job's directory on a host."""
    return posixpath.join(site.home, "jobs", job_id)


def sync_config(spec: JobSpec, job_id: str, cluster: ClusterSpec, adir: str, *,
                relay_addr: str, checkpoint: CheckpointSettings | None,
                relay_socket: str | None = None) -> SyncConfig:
    """The runtime's part: how a worker of `cluster` reaches its relay (`relay_socket`: on the
    relay's own host, see `relay_socket()`) and runs the outer loop."""
    relay = spec.relay
    assert relay is not None  # only for a spec with a relay
    sync, comp = relay.sync, relay.compression
    return SyncConfig(
        job_id=job_id, cluster=cluster.name, relay_addr=relay_addr, relay_socket=relay_socket,
        tls=_tls(adir, WORKER), mode=sync.mode, inner_steps=sync.first_inner_steps,
        every_s=sync.every, auto_steps=auto_steps(spec), outer_lr=sync.outer_lr,
        outer_momentum=sync.outer_momentum, nesterov=sync.nesterov, overlap=sync.overlap,
        overlap_steps=sync.overlap_steps, codec=comp.codec,
        error_feedback=comp.error_feedback, round_timeout=relay.timeout, checkpoint=checkpoint)


def auto_steps(spec: JobSpec) -> AutoSteps | None:
    """How the relays choose H with ``inner_steps: auto`` (None: a fixed H, or time-based)."""
    sync = spec.relay.sync if spec.relay is not None else None
    if sync is None or not sync.auto:
        return None
    return AutoSteps(target_utilization=sync.target_utilization,
                     min_steps=sync.min_inner_steps, max_steps=sync.max_inner_steps,
                     overlap=sync.overlap)


def _relay_agents(spec: JobSpec, job_id: str, sites: dict[str, Site], ports: Ports,
                  certs: Certs | None) -> list[AgentPlan]:
    """One relay agent per cluster, on its gateway, with relay.json and its certificates."""
    if spec.relay is None:
        return []
    assert certs is not None  # build_plan's contract
    plans = []
    for cluster in spec.clusters:
        gateway = cluster.gateway_host
        site = _gateway_site(cluster, sites)
        job_root = job_root_of(site, job_id)
        adir = agent_dir(job_root, cluster.name, gateway.host, RELAY)
        node_rank = [h.host for h in cluster.hosts].index(gateway.host)
        env = {"NEBULA_JOB_ID": job_id, "NEBULA_CLUSTER": cluster.name,
               "NEBULA_HOST": gateway.host, **base_env(site, job_root)}
        config = AgentConfig(
            job_id=job_id, cluster=cluster.name, host=gateway.host, role=RELAY, cwd=adir,
            grace=RELAY_GRACE, max_restarts=max(spec.max_restarts, RELAY_RESTARTS),
            restart_backoff=RELAY_RESTART_BACKOFF,
            processes=[ProcessConfig(
                name="relay",
                argv=[site.python, "-m", "nebula_cli.relay",
                      "--config", posixpath.join(adir, "relay.json")],
                env=env, log="logs/relay.log", metrics="metrics/relay.jsonl")])
        cert, key = certs.relays[cluster.name]
        relay_json = relay_config(spec, job_id, cluster, adir, ports, sites)
        files = {"relay.json": strict.dumps(relay_json),
                 **dict(zip(cert_names(RELAY), (certs.ca, cert, key), strict=True))}
        plans.append(AgentPlan(
            cluster=cluster.name, host=gateway.host, role=RELAY, node_rank=node_rank, slots=1,
            conn=_conn(site, job_root), job_root=job_root, config=config, files=files))
    return plans


def relay_config(spec: JobSpec, job_id: str, cluster: ClusterSpec, adir: str, ports: Ports,
                 sites: dict[str, Site]) -> RelayConfig:
    """The relay's part of the plan (relay.json) for `cluster`."""
    relay = spec.relay
    assert relay is not None

    def dial_address(c: ClusterSpec) -> str:
        return c.relay_address or _gateway_site(c, sites).address

    bind = _gateway_site(cluster, sites).bind
    peer_port, worker_port = ports.relays[cluster.name]
    shaping = relay.shaping
    return RelayConfig(
        job_id=job_id,
        cluster=cluster.name,
        clusters=spec.dial_order,
        peer_listen=f"{bind}:{peer_port}",
        worker_listen=f"{bind}:{worker_port}",
        worker_socket=posixpath.join(adir, WORKER_SOCKET),
        peers={c.name: f"{dial_address(c)}:{ports.relays[c.name][0]}"
               for c in spec.clusters if c.name != cluster.name},
        tls=_tls(adir, RELAY),
        codec=relay.compression.codec,
        error_feedback=relay.compression.error_feedback,
        block_size=relay.compression.block_size,
        density=relay.compression.density, bits=relay.compression.bits,
        auto_steps=auto_steps(spec), round_timeout=relay.timeout,
        heartbeat=relay.heartbeat, dead_after=relay.dead_after,
        shaping=ShapingConfig(rate_mbit=shaping.rate_mbit if shaping else None,
                              delay_ms=shaping.delay_ms if shaping else 0.0),
        status_file=posixpath.join(adir, "relay-status.json"),
        metrics_file=posixpath.join(adir, "metrics", "relay.jsonl"),
    )
