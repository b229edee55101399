"""`Scheduler`: what a cluster's scheduler means for the spec and the plan.

A cluster's `scheduler:` names one (`registry`). This side answers what can be known from the
spec alone: what a cluster of that scheduler may say, how many hosts and ranks it runs, where
each node keeps its checkpoints, whether its nodes share files. How its hosts are obtained and
ended at launch, through a transport, is the control plane's side: `nebula_cli.scheduler`'s
`Allocator` of the same name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from nebula_cli.config.hosts import HostSpec
from nebula_cli.config.sections import SpecModel
from nebula_cli.config.yaml_positions import PathKey

if TYPE_CHECKING:
    from nebula_cli.config.cluster import ClusterSpec


class Scheduler(Protocol):
    """A scheduler as the spec and the plan see it (stateless; one instance per name)."""

    name: str
    """What a cluster's `scheduler:` says."""
    title: str
    """Its name in messages ("Slurm")."""
    allocates: bool
    """Its hosts come from an allocation made at launch (the spec's one host is where it is
    asked for, its login node): they are known only once the allocation runs."""
    relay_on_login: bool
    """`relay_on: login` may run the cluster's relay on that login node."""
    nodes_share_files: bool
    """The allocation's nodes share one file system: what the first node uploads, every node
    sees."""

    def section(self, cluster: ClusterSpec) -> SpecModel | None:
        """Its own section of the cluster as written (`slurm:`), None when absent or when it
        has none (a section given to a cluster of another scheduler is refused)."""
        ...

    def problems(self, cluster: ClusterSpec) -> list[tuple[PathKey, str]]:
        """What a cluster of this scheduler may not say (path under the cluster, message)."""
        ...

    def node_count(self, cluster: ClusterSpec) -> int:
        """The hosts that run workers."""
        ...

    def process_count(self, cluster: ClusterSpec) -> int:
        """The cluster's DeepSpeed ranks."""
        ...

    def allocated_hosts(self, cluster: ClusterSpec, nodes: dict[str, str]) -> list[HostSpec]:
        """The hosts that run the workers once the allocation runs on `nodes` (name ->
        address, in the scheduler's order); a scheduler that allocates nothing keeps the
        spec's hosts."""
        ...

    def rank_env(self, cluster: ClusterSpec, rank: int, local_rank: int) -> dict[str, str]:
        """What a rank's environment says of it in the scheduler's own words, beside RANK and
        LOCAL_RANK (empty for a scheduler that has none)."""
        ...

    def checkpoint_host(self, cluster: ClusterSpec, host: HostSpec | int) -> str:
        """A host's part of its checkpoint path (`host` may be a node's index)."""
        ...

    def checkpoint_places(self, cluster: ClusterSpec, host: HostSpec) -> list[HostSpec | int]:
        """The places whose checkpoints the spec's `host` sees: itself, or from a login node
        every node of the allocation (by index)."""
        ...

    def summary(self, cluster: ClusterSpec) -> str | None:
        """What `validate` says of the cluster's hosts beyond the count, or None."""
        ...
