"""A job's DeepSpeed worlds: which world a cluster's ranks belong to, where each world's rank 0
runs, the interface each host's ranks use, and the variables every rank of a host shares.

Re-exported by `nebula_cli.config.jobplan`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nebula_cli.config.pipeline import device_id
from nebula_cli.config.spec import ClusterSpec, HostSpec, JobSpec

if TYPE_CHECKING:
    from nebula_cli.config.plan_model import Site

PIPELINE_WORLD = "*pipeline*"
"""The key of the one DeepSpeed world of a pipelined job in `Ports.masters`."""


def site_key(cluster: ClusterSpec, host: HostSpec) -> str:
    return f"{cluster.name}/{host.host}"


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


def interface_of(cluster: ClusterSpec, host: HostSpec, site: Site | None = None) -> str | None:
    """GLOO/NCCL_SOCKET_IFNAME for a host's ranks: the spec's (the host's, else its cluster's),
    else the one found toward its world's peers (`site.interface`); None: gloo's own choice."""
    return host.interface or cluster.interface or (site.interface if site else None)


def route_targets(spec: JobSpec, sites: dict[str, Site]) -> dict[str, str]:
    """site key -> the peer address whose route names the host's interface: the world's master
    (for the master, the next host of the world). Only hosts of worlds of two or more hosts
    whose spec names no interface (one host talks to itself over loopback)."""
    members: dict[str, list[str]] = {}
    named = set()
    for cluster in spec.clusters:
        for host in cluster.hosts:
            members.setdefault(world_of(spec, cluster), []).append(site_key(cluster, host))
            if interface_of(cluster, host):
                named.add(site_key(cluster, host))
    targets = {}
    for world, (c, h) in rendezvous_hosts(spec).items():
        keys = members.get(world, [])
        master = site_key(c, h)
        others = [k for k in keys if k != master]
        for key in keys:
            if key not in named and others:
                peer = master if key != master else others[0]
                targets[key] = sites[peer].address
    return targets


def world_env(spec: JobSpec, job_id: str, cluster_index: int, node_rank: int,
               master_port: int, master_addr: str, interface: str | None) -> dict[str, str]:
    """The variables every rank of one host shares (rank-specific ones excluded)."""
    cluster = spec.clusters[cluster_index]
    host = cluster.hosts[node_rank]
    env = {
        "NEBULA_JOB_ID": job_id,
        "NEBULA_CLUSTER": cluster.name,
        "NEBULA_HOST": host.host,
        "NEBULA_NODE_RANK": str(node_rank),
        "NEBULA_NUM_NODES": str(len(cluster.hosts)),
        "NEBULA_NUM_CLUSTERS": str(len(spec.clusters)),
        "NEBULA_CLUSTER_INDEX": str(cluster_index),
        "WORLD_SIZE": str(sum(h.slots for h in cluster.hosts)),
        "LOCAL_SIZE": str(host.slots),
        "CROSS_RANK": str(node_rank),
        "CROSS_SIZE": str(len(cluster.hosts)),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
    if interface:
        env["GLOO_SOCKET_IFNAME"] = interface
        env["NCCL_SOCKET_IFNAME"] = interface
    return env


def pipeline_env(spec: JobSpec, world_size: int, stages: int) -> dict[str, str]:
    """What every rank of a pipelined job shares: the job-wide world and the stage count."""
    hosts = [h for c in spec.clusters for h in c.hosts]
    return {"WORLD_SIZE": str(world_size), "NEBULA_PIPELINE_STAGES": str(stages),
            "NEBULA_PIPELINE_REPLICAS": str(world_size // stages),
            "CROSS_SIZE": str(len(hosts))}
