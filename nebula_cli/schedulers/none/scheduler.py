"""`NoScheduler` (`scheduler: none`, the default): the spec's hosts run the workers as they
are; nothing is asked of anyone at launch."""

from __future__ import annotations

from nebula_cli.config.hosts import HostSpec
from nebula_cli.config.schedulers.base import ClusterView
from nebula_cli.config.yaml_positions import PathKey


class NoScheduler:
    """Hosts as written: one checkpoint directory per host, by its name."""

    name = "none"
    title = "unscheduled"
    allocates = False
    relay_on_login = False
    nodes_share_files = False
    section_model = None
    section_doc = ""

    def problems(self, cluster: ClusterView) -> list[tuple[PathKey, str]]:
        return []

    def node_count(self, cluster: ClusterView) -> int:
        return len(cluster.hosts)

    def process_count(self, cluster: ClusterView) -> int:
        return sum(h.slots for h in cluster.hosts)

    def allocated_hosts(self, cluster: ClusterView, nodes: dict[str, str]) -> list[HostSpec]:
        return list(cluster.hosts)

    def rank_env(self, cluster: ClusterView, rank: int, local_rank: int) -> dict[str, str]:
        return {}

    def checkpoint_host(self, cluster: ClusterView, host: HostSpec | int) -> str:
        if isinstance(host, int):
            raise TypeError(f"cluster {cluster.name!r} has no allocation: name its host, not "
                            f"node {host}")
        return host.host

    def checkpoint_places(self, cluster: ClusterView, host: HostSpec) -> list[HostSpec | int]:
        return [host]

    def summary(self, cluster: ClusterView) -> str | None:
        return None

    def node_memory(self, cluster: ClusterView) -> tuple[int, str] | None:
        return None  # the hosts are probed instead (validate --hosts)


SCHEDULER = NoScheduler()
"""`scheduler: none` (`nebula_cli.schedulers.registry`)."""
