"""`DummyScheduler` (`scheduler: dummy`): the cluster's one host asks for `pods` pods."""

from __future__ import annotations

from nebula_cli.config.hosts import HostSpec
from nebula_cli.config.schedulers.base import ClusterView
from nebula_cli.config.yaml_positions import PathKey

from .spec import DummySpec


def request(cluster: ClusterView) -> DummySpec:
    section = cluster.section(SCHEDULER.name)
    assert section is None or isinstance(section, DummySpec)
    return section or DummySpec()


class DummyScheduler:
    """Pods from nowhere: a skeleton that validates, counts and names its nodes."""

    name = "dummy"
    title = "Dummy"
    allocates = False
    relay_on_login = False
    nodes_share_files = False
    section_model = DummySpec
    section_doc = "What to ask the dummy scheduler for (scheduler: dummy)."

    def problems(self, cluster: ClusterView) -> list[tuple[PathKey, str]]:
        if len(cluster.hosts) > 1:
            return [(("hosts",), "a dummy cluster has one host")]
        return []

    def node_count(self, cluster: ClusterView) -> int:
        return request(cluster).pods

    def process_count(self, cluster: ClusterView) -> int:
        return request(cluster).pods

    def allocated_hosts(self, cluster: ClusterView, nodes: dict[str, str]) -> list[HostSpec]:
        return list(cluster.hosts)

    def rank_env(self, cluster: ClusterView, rank: int, local_rank: int) -> dict[str, str]:
        return {"DUMMY_POD": str(rank)}

    def checkpoint_host(self, cluster: ClusterView, host: HostSpec | int) -> str:
        return f"pod{host if isinstance(host, int) else cluster.hosts.index(host)}"

    def checkpoint_places(self, cluster: ClusterView, host: HostSpec) -> list[HostSpec | int]:
        return list(range(request(cluster).pods))

    def summary(self, cluster: ClusterView) -> str:
        return f"{request(cluster).pods} dummy pod(s)"


SCHEDULER = DummyScheduler()
