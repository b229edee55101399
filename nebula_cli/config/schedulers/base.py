"""`Scheduler`: what a cluster's scheduler means for the spec and the plan.

A cluster's `scheduler:` names one (`registry`). This side answers what can be known from the
spec alone: what a cluster of that scheduler may say, how many hosts and ranks it runs, where
each node keeps its checkpoints, whether its nodes share files. How its hosts are obtained and
ended at launch, through a transport, is the control plane's side: `nebula_cli.scheduler`'s
`Allocator` of the same name.
"""

from __future__ import annotations

from typing import Protocol

from nebula_cli.config.hosts import HostSpec
from nebula_cli.config.sections import SpecModel
from nebula_cli.config.yaml_positions import PathKey


class ClusterView(Protocol):
    """A cluster of the spec as its scheduler reads it (`config.cluster.ClusterSpec` is one; a
    scheduler imports nothing of the spec's model, which is built from the schedulers)."""

    @property
    def name(self) -> str: ...

    @property
    def hosts(self) -> list[HostSpec]: ...

    @property
    def gateway(self) -> str | None: ...

    def section(self, name: str) -> SpecModel | None:
        """The cluster's section `name:` (a scheduler's own, `slurm:`), None when absent."""
        ...


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

    section_model: type[SpecModel] | None
    """The model of its own section of a cluster, a field named as the scheduler (`slurm:`,
    `SlurmSpec`), or None when it has none: `config.cluster.ClusterSpec` has a field for each
    registered scheduler's (a section given to a cluster of another scheduler is refused)."""
    section_doc: str
    """That field's description (the spec's reference), empty without a section."""

    def problems(self, cluster: ClusterView) -> list[tuple[PathKey, str]]:
        """What a cluster of this scheduler may not say (path under the cluster, message)."""
        ...

    def node_count(self, cluster: ClusterView) -> int:
        """The hosts that run workers."""
        ...

    def process_count(self, cluster: ClusterView) -> int:
        """The cluster's DeepSpeed ranks."""
        ...

    def allocated_hosts(self, cluster: ClusterView, nodes: dict[str, str]) -> list[HostSpec]:
        """The hosts that run the workers once the allocation runs on `nodes` (name ->
        address, in the scheduler's order); a scheduler that allocates nothing keeps the
        spec's hosts."""
        ...

    def rank_env(self, cluster: ClusterView, rank: int, local_rank: int) -> dict[str, str]:
        """What a rank's environment says of it in the scheduler's own words, beside RANK and
        LOCAL_RANK (empty for a scheduler that has none)."""
        ...

    def checkpoint_host(self, cluster: ClusterView, host: HostSpec | int) -> str:
        """A host's part of its checkpoint path (`host` may be a node's index)."""
        ...

    def checkpoint_places(self, cluster: ClusterView, host: HostSpec) -> list[HostSpec | int]:
        """The places whose checkpoints the spec's `host` sees: itself, or from a login node
        every node of the allocation (by index)."""
        ...

    def summary(self, cluster: ClusterView) -> str | None:
        """What `validate` says of the cluster's hosts beyond the count, or None."""
        ...

    def node_memory(self, cluster: ClusterView) -> tuple[int, str] | None:
        """The memory each allocated node grants the job's processes, and where that was said
        (an sbatch option), when the spec fixes it; None when it does not (the nodes' own
        memory, unknown before launch) or nothing is allocated."""
        ...
