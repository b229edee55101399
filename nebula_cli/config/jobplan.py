"""From a JobSpec to the processes to start: which host runs what, with which ranks and env.

Pure data, no I/O: the orchestrator carries the plan out through transports.
"""

from __future__ import annotations

import os
import posixpath
import sys
from dataclasses import dataclass, field
from typing import Any

from nebula_cli.config.pipeline import device_id
from nebula_cli.config.spec import ClusterSpec, HostSpec, JobSpec

WORKER = "worker"
RELAY = "relay"
# A relay is restarted this often at least: a cluster whose relay died rejoins and catches up.
RELAY_RESTARTS = 3


@dataclass(eq=False)
class ProcessPlan:
    """One agent to start: a role (worker or relay) on one host of one cluster."""

    cluster: str
    host: str
    role: str
    node_rank: int
    slots: int
    conn: dict[str, Any]  # how to reach the host (see transport.connect)
    job_root: str  # the job's directory on that host
    agent_config: dict[str, Any] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # extra files, relative to agent_dir

    @property
    def agent_dir(self) -> str:
        return posixpath.join(self.job_root, self.cluster, self.host, self.role)

    @property
    def key(self) -> str:
        return f"{self.cluster}/{self.host}/{self.role}"

    def __str__(self) -> str:
        return self.key

    @property
    def logs(self) -> dict[str, str]:
        """rank (or role name) -> log path relative to the agent dir."""
        return {str(p["rank"]): p["log"] for p in self.agent_config.get("processes", [])}

    @property
    def metrics(self) -> dict[str, str]:
        """rank (or role name) -> metrics path relative to the agent dir."""
        return {str(p["rank"]): p["metrics"] for p in self.agent_config.get("processes", [])
                if "metrics" in p}


def connection_of(cluster: ClusterSpec, host: HostSpec, local_home: str) -> dict[str, Any]:
    """What a transport needs to reach `host`: plain data, kept in the state store."""
    if cluster.transport == "local":
        python = sys.executable if cluster.python == "python3" else cluster.python
        return {"transport": "local", "name": host.host, "home": local_home, "python": python}
    return {
        "transport": "ssh", "name": host.host, "host": host.host, "user": host.user,
        "port": host.port, "key": host.key, "jump": cluster.jump, "python": cluster.python,
    }


def host_address(cluster: ClusterSpec, host: HostSpec) -> str:
    """The address other hosts of the cluster use to reach `host`."""
    if host.address:
        return host.address
    return "127.0.0.1" if cluster.transport == "local" else host.host


def worker_env(
    spec: JobSpec, job_id: str, cluster_index: int, node_rank: int, master_port: int,
    extra: dict[str, str], master_addr: str,
) -> dict[str, str]:
    """The environment shared by every rank of one host (rank-specific variables excluded)."""
    cluster = spec.clusters[cluster_index]
    host = cluster.hosts[node_rank]
    world = sum(h.slots for h in cluster.hosts)
    env: dict[str, str] = {**spec.env, **cluster.env}
    env.update({
        "NEBULA_JOB_ID": job_id,
        "NEBULA_CLUSTER": cluster.name,
        "NEBULA_HOST": host.host,
        "NEBULA_NODE_RANK": str(node_rank),
        "NEBULA_NUM_NODES": str(len(cluster.hosts)),
        "NEBULA_NUM_CLUSTERS": str(len(spec.clusters)),
        "NEBULA_CLUSTER_INDEX": str(cluster_index),
        "WORLD_SIZE": str(world),
        "LOCAL_SIZE": str(host.slots),
        "CROSS_RANK": str(node_rank),
        "CROSS_SIZE": str(len(cluster.hosts)),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "PYTHONUNBUFFERED": "1",
    })
    interface = host.interface or cluster.interface
    if interface:
        env["GLOO_SOCKET_IFNAME"] = interface
        env["NCCL_SOCKET_IFNAME"] = interface
    env.update(extra)
    return env


@dataclass(frozen=True)
class Site:
    """Where a host keeps nebula's files and the address its cluster peers reach it at."""

    home: str  # absolute path of nebula's directory on the host
    address: str


def lib_dir(job_root: str) -> str:
    """Where the nebula_cli package is uploaded on a remote host (put on PYTHONPATH)."""
    return posixpath.join(job_root, "lib")


def base_env(cluster: ClusterSpec, job_root: str, python: str) -> dict[str, str]:
    """PATH/PYTHONPATH so that `python` and `nebula_cli` are the right ones on that host."""
    if cluster.transport == "local":
        # `python` in the run command is the interpreter nebula runs under.
        bindir = os.path.dirname(python)
        return {"PATH": bindir + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")}
    env = {"PYTHONPATH": lib_dir(job_root)}
    if posixpath.isabs(python):  # `python` in the run command is the cluster's python
        env["NEBULA_PATH_PREPEND"] = posixpath.dirname(python)
    return env


PIPELINE_WORLD = "*pipeline*"
"""The key of the one DeepSpeed world of a pipelined job in `master_ports`."""


def world_of(spec: JobSpec, cluster: ClusterSpec) -> str:
    """The DeepSpeed world a cluster's ranks belong to: its own, or the job-wide pipeline."""
    return PIPELINE_WORLD if spec.pipeline_layout() is not None else cluster.name


def rendezvous_hosts(spec: JobSpec) -> dict[str, tuple[ClusterSpec, HostSpec]]:
    """world -> the host running its rank 0 (DeepSpeed's master), where its port must be free."""
    layout = spec.pipeline_layout()
    if layout is None:
        return {c.name: (c, c.hosts[0]) for c in spec.clusters}
    first = layout.stages[0][0]  # rank 0: stage 0 of replica 0
    for c in spec.clusters:
        for h in c.hosts:
            if any(device_id(c.name, h.host, slot) == first for slot in range(h.slots)):
                return {PIPELINE_WORLD: (c, h)}
    raise AssertionError(f"device {first} of the layout is not in the spec")  # spec checked it


def plan_workers(
    spec: JobSpec, job_id: str, *, sites: dict[str, Site], local_home: str,
    master_ports: dict[str, int],
) -> list[ProcessPlan]:
    """One worker agent per host: `slots` processes each running `spec.run` in the workdir.

    `sites` maps "cluster/host" to the host's Site; `master_ports` maps a world (see
    `rendezvous_hosts`) to its rendezvous port. Data parallel: one world per cluster, ranks in
    host order. Pipeline: one world over every cluster, ranks from the pipeline layout."""
    plans = []
    layout = spec.pipeline_layout()
    masters = {world: sites[f"{c.name}/{h.host}"].address
               for world, (c, h) in rendezvous_hosts(spec).items()}
    host_index = 0  # across the clusters: CROSS_RANK of a pipelined world
    for ci, cluster in enumerate(spec.clusters):
        rank = 0
        world = world_of(spec, cluster)
        for node_rank, host in enumerate(cluster.hosts):
            local = cluster.transport == "local"
            site = sites[f"{cluster.name}/{host.host}"]
            plan = ProcessPlan(
                cluster=cluster.name, host=host.host, role=WORKER, node_rank=node_rank,
                slots=host.slots, conn=connection_of(cluster, host, local_home),
                job_root=posixpath.join(site.home, "jobs", job_id),
            )
            if not local:
                plan.conn["pythonpath"] = lib_dir(plan.job_root)
            extra = base_env(cluster, plan.job_root, plan.conn["python"])
            env = worker_env(spec, job_id, ci, node_rank, master_ports[world], extra,
                             masters[world])
            if layout is not None:
                env.update(pipeline_env(spec, layout.world_size, layout.num_stages),
                           CROSS_RANK=str(host_index))
            host_index += 1
            cwd = spec.workdir if local else posixpath.join(plan.job_root, "work")
            if spec.deepspeed is not None:
                env["NEBULA_DS_CONFIG"] = posixpath.join(plan.job_root, "ds_config.json")
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
                    plan.agent_dir, "metrics", f"rank{name}.jsonl")
                processes.append({
                    "rank": int(name),
                    "argv": ["/bin/sh", "-c", spec.run],
                    "env": proc_env,
                    "log": f"logs/rank{name}.log",
                    "metrics": f"metrics/rank{name}.jsonl",
                })
                rank += 1
            plan.agent_config = {
                "job_id": job_id, "cluster": cluster.name, "host": host.host, "role": WORKER,
                "cwd": cwd, "grace": spec.grace, "max_restarts": spec.max_restarts,
                "restart_backoff": 5.0, "processes": processes,
            }
            plans.append(plan)
    return plans


def pipeline_env(spec: JobSpec, world_size: int, stages: int) -> dict[str, str]:
    """What every rank of a pipelined job shares: the job-wide world and the stage count."""
    hosts = [h for c in spec.clusters for h in c.hosts]
    return {"WORLD_SIZE": str(world_size), "NEBULA_PIPELINE_STAGES": str(stages),
            "NEBULA_PIPELINE_REPLICAS": str(world_size // stages),
            "CROSS_SIZE": str(len(hosts))}


def relay_worker_env(spec: JobSpec, cluster: ClusterSpec, worker_port: int,
                     cert_dir: str, relay_host: str) -> dict[str, str]:
    """What the workers of `cluster` need to reach their relay and run the outer loop."""
    relay = spec.relay
    assert relay is not None  # only called for a spec with a relay
    sync, comp = relay.sync, relay.compression
    return {
        "NEBULA_RELAY_ADDR": f"{relay_host}:{worker_port}",
        "NEBULA_TLS_CA": posixpath.join(cert_dir, "ca.pem"),
        "NEBULA_TLS_CERT": posixpath.join(cert_dir, "worker.pem"),
        "NEBULA_TLS_KEY": posixpath.join(cert_dir, "worker.key"),
        "NEBULA_SYNC_MODE": sync.mode,
        "NEBULA_INNER_STEPS": str(sync.inner_steps),
        "NEBULA_OUTER_LR": str(sync.outer_lr),
        "NEBULA_OUTER_MOMENTUM": str(sync.outer_momentum),
        "NEBULA_OUTER_NESTEROV": "1" if sync.nesterov else "0",
        "NEBULA_SYNC_OVERLAP": "1" if sync.overlap else "0",
        **({"NEBULA_OVERLAP_STEPS": str(sync.overlap_steps)} if sync.overlap_steps else {}),
        "NEBULA_CODEC": comp.codec,
        "NEBULA_ERROR_FEEDBACK": "1" if comp.error_feedback else "0",
        "NEBULA_ROUND_TIMEOUT": str(relay.timeout),
    }


def plan_relays(
    spec: JobSpec, job_id: str, *, sites: dict[str, Site], local_home: str,
) -> list[ProcessPlan]:
    """One relay agent per cluster, on its gateway. The relay's config (`relay_config`) and
    certificates are added by the caller."""
    if spec.relay is None:
        return []
    plans = []
    for cluster in spec.clusters:
        gateway = cluster.gateway_host
        site = sites[f"{cluster.name}/{gateway.host}"]
        node_rank = [h.host for h in cluster.hosts].index(gateway.host)
        plan = ProcessPlan(
            cluster=cluster.name, host=gateway.host, role=RELAY, node_rank=node_rank, slots=1,
            conn=connection_of(cluster, gateway, local_home),
            job_root=posixpath.join(site.home, "jobs", job_id),
        )
        if cluster.transport != "local":
            plan.conn["pythonpath"] = lib_dir(plan.job_root)
        env = {"NEBULA_JOB_ID": job_id, "NEBULA_CLUSTER": cluster.name,
               "NEBULA_HOST": gateway.host, "PYTHONUNBUFFERED": "1",
               **base_env(cluster, plan.job_root, plan.conn["python"])}
        plan.agent_config = {
            "job_id": job_id, "cluster": cluster.name, "host": gateway.host, "role": RELAY,
            "cwd": plan.agent_dir, "grace": 5.0,
            "max_restarts": max(spec.max_restarts, RELAY_RESTARTS), "restart_backoff": 1.0,
            "processes": [{
                "rank": "relay",
                "argv": [plan.conn["python"], "-m", "nebula_cli.relay.server",
                         "--config", posixpath.join(plan.agent_dir, "relay.json")],
                "env": env,
                "log": "logs/relay.log",
                "metrics": "metrics/relay.jsonl",
            }],
        }
        plans.append(plan)
    return plans


def relay_config(
    spec: JobSpec, job_id: str, cluster: ClusterSpec, agent_dir: str,
    ports: dict[str, tuple[int, int]], sites: dict[str, Site],
) -> dict[str, Any]:
    """relay.json for `cluster`'s relay (see nebula_cli.relay.config.RelayConfig)."""
    relay = spec.relay
    assert relay is not None
    by_name = {c.name: c for c in spec.clusters}
    local = cluster.transport == "local"

    def dial_address(c: ClusterSpec) -> str:
        return c.relay_address or sites[f"{c.name}/{c.gateway_host.host}"].address

    bind = "127.0.0.1" if local else "0.0.0.0"
    shaping = relay.shaping
    cert_dir = posixpath.join(agent_dir, "certs")
    return {
        "job_id": job_id,
        "cluster": cluster.name,
        "clusters": [c.name for c in spec.clusters],
        "peer_listen": f"{bind}:{ports[cluster.name][0]}",
        "worker_listen": f"{bind}:{ports[cluster.name][1]}",
        "peers": {
            name: f"{dial_address(c)}:{ports[name][0]}"
            for name, c in by_name.items() if name != cluster.name
        },
        "tls": {"ca": posixpath.join(cert_dir, "ca.pem"),
                "cert": posixpath.join(cert_dir, "relay.pem"),
                "key": posixpath.join(cert_dir, "relay.key")},
        "codec": relay.compression.codec,
        "error_feedback": relay.compression.error_feedback,
        "block_size": relay.compression.block_size,
        "round_timeout": relay.timeout,
        "heartbeat": relay.heartbeat,
        "shaping": {"rate_mbit": shaping.rate_mbit if shaping else None,
                    "delay_ms": shaping.delay_ms if shaping else 0.0},
        "status_file": posixpath.join(agent_dir, "relay-status.json"),
        "metrics_file": posixpath.join(agent_dir, "metrics", "relay.jsonl"),
    }
