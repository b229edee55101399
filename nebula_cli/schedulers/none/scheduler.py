"""`NoScheduler` (`scheduler: none`, the default): the spec's hosts run the workers as they
are; nothing is asked of anyone at launch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nebula_cli.config.hosts import HostSpec
from nebula_cli.config.sections import SpecModel
from nebula_cli.config.yaml_positions import PathKey

if TYPE_CHECKING:
    from nebula_cli.config.cluster import ClusterSpec


class NoScheduler:
    """Hosts as written: one checkpoint directory per host, by its name."""

    name = "none"
    title = "unscheduled"
    allocates = False
    relay_on_login = False
    nodes_share_files = False

    def section(self, cluster: ClusterSpec) -> SpecModel | None:
        return None

    def problems(self, cluster: ClusterSpec) -> list[tuple[PathKey, str]]:
        return []

    def node_count(self, cluster: ClusterSpec) -> int:
        return len(cluster.hosts)

    def process_count(self, cluster: ClusterSpec) -> int:
        return sum(h.slots for h in cluster.hosts)

    def allocated_hosts(self, cluster: ClusterSpec, nodes: dict[str, str]) -> list[HostSpec]:
        return list(cluster.hosts)

    def rank_env(self, cluster: ClusterSpec, rank: int, local_rank: int) -> dict[str, str]:
        return {}

    def checkpoint_host(self, cluster: ClusterSpec, host: HostSpec | int) -> str:
        if isinstance(host, int):
            raise TypeError(f"cluster {cluster.name!r} has no allocation: name its host, not "
                            f"node {host}")
        return host.host

    def checkpoint_places(self, cluster: ClusterSpec, host: HostSpec) -> list[HostSpec | int]:
        return [host]

    def summary(self, cluster: ClusterSpec) -> str | None:
        return None
