"""`WorkerHost`: one host of a cluster as the plan builds its worker agent; what a role is
given to decide that host's processes."""

from __future__ import annotations

from dataclasses import dataclass

from nebula_cli.config.plan_model import Certs, Ports, Site
from nebula_cli.config.spec import ClusterSpec, HostSpec, JobSpec


@dataclass(frozen=True)
class WorkerHost:
    """The spec, the host's place in it and what the plan learnt of the hosts."""

    spec: JobSpec
    job_id: str
    cluster: ClusterSpec
    host: HostSpec
    node_rank: int
    """The host's place in its cluster (0: the first host)."""
    site: Site
    """What the host's transport reported."""
    job_root: str
    """The job's directory on the host."""
    agent_dir: str
    """The worker agent's directory on the host (its files go there)."""
    sites: dict[str, Site]
    """Every host's site, by `worlds.site_key` (where the cluster's relay is, for one)."""
    ports: Ports
    certs: Certs | None
    """The job's PEM files (None without a relay)."""
