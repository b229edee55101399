"""From a JobSpec to the processes to start: which host runs what, with which ranks and env.

Pure data, no I/O: the orchestrator carries the plan out through transports.
"""

from __future__ import annotations

import os
import posixpath
import sys
from dataclasses import dataclass, field
from typing import Any

from nebula_cli.spec import ClusterSpec, HostSpec, JobSpec

WORKER = "worker"
RELAY = "relay"


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
    extra: dict[str, str],
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
        "MASTER_ADDR": host_address(cluster, cluster.hosts[0]),
        "MASTER_PORT": str(master_port),
        "PYTHONUNBUFFERED": "1",
    })
    interface = host.interface or cluster.interface
    if interface:
        env["GLOO_SOCKET_IFNAME"] = interface
        env["NCCL_SOCKET_IFNAME"] = interface
    env.update(extra)
    return env


def plan_workers(
    spec: JobSpec, job_id: str, *, local_home: str, remote_home: str = "~/.nebula",
    master_ports: dict[str, int], extra_env: dict[str, dict[str, str]] | None = None,
) -> list[ProcessPlan]:
    """One worker agent per host: `slots` processes each running `spec.run` in the workdir.

    `extra_env` maps "cluster/host" to variables added to that host's processes (relay address,
    certificate paths). `master_ports` maps cluster name to its rendezvous port."""
    plans = []
    for ci, cluster in enumerate(spec.clusters):
        rank = 0
        for node_rank, host in enumerate(cluster.hosts):
            local = cluster.transport == "local"
            home = local_home if local else remote_home
            plan = ProcessPlan(
                cluster=cluster.name, host=host.host, role=WORKER, node_rank=node_rank,
                slots=host.slots, conn=connection_of(cluster, host, local_home),
                job_root=posixpath.join(home, "jobs", job_id),
            )
            extra = dict((extra_env or {}).get(f"{cluster.name}/{host.host}", {}))
            if local:
                # `python` in the run command is the interpreter nebula runs under.
                bindir = os.path.dirname(plan.conn["python"])
                extra["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")
            env = worker_env(spec, job_id, ci, node_rank, master_ports[cluster.name], extra)
            cwd = spec.workdir if local else posixpath.join(plan.job_root, "work")
            if spec.deepspeed is not None:
                env["NEBULA_DS_CONFIG"] = posixpath.join(plan.job_root, "ds_config.json")
            processes = []
            for local_rank in range(host.slots):
                processes.append({
                    "rank": rank,
                    "argv": ["/bin/sh", "-c", spec.run],
                    "env": {
                        **env, "RANK": str(rank), "LOCAL_RANK": str(local_rank),
                        "NEBULA_METRICS_FILE": posixpath.join(
                            plan.agent_dir, "metrics", f"rank{rank}.jsonl"),
                    },
                    "log": f"logs/rank{rank}.log",
                })
                rank += 1
            plan.agent_config = {
                "job_id": job_id, "cluster": cluster.name, "host": host.host, "role": WORKER,
                "cwd": cwd, "grace": spec.grace, "max_restarts": spec.max_restarts,
                "restart_backoff": 5.0, "processes": processes,
            }
            plans.append(plan)
    return plans
