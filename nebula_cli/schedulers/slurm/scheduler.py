"""`SlurmScheduler` (`scheduler: slurm`): the cluster's one host is a Slurm login node; one
batch job (its `slurm:` section, `SlurmSpec`) holds the nodes that run the workers.

Submitting and cancelling that job is `allocator`; here is what the spec and the plan know of
it beforehand.
"""

from __future__ import annotations

from nebula_cli.config.hosts import HostSpec
from nebula_cli.config.schedulers.base import ClusterView
from nebula_cli.config.yaml_positions import PathKey
from nebula_cli.schedulers.slurm.spec import SlurmSpec


def slurm_request(cluster: ClusterView) -> SlurmSpec:
    """What to ask Slurm for: the cluster's `slurm:` (its defaults when absent)."""
    section = cluster.section(SCHEDULER.name)
    assert section is None or isinstance(section, SlurmSpec)
    return section or SlurmSpec()


class SlurmScheduler:
    """A Slurm cluster: nodes from one allocation, on a shared file system, named by their
    place in it."""

    name = "slurm"
    title = "Slurm"
    allocates = True
    relay_on_login = True
    nodes_share_files = True
    section_model = SlurmSpec
    section_doc = "What to ask Slurm for (scheduler: slurm)."

    def problems(self, cluster: ClusterView) -> list[tuple[PathKey, str]]:
        problems: list[tuple[PathKey, str]] = []
        if len(cluster.hosts) > 1:
            names = [h.host for h in cluster.hosts]
            problems.append((("hosts",), f"a Slurm cluster has one host, its login node "
                                         f"(the nodes come from the allocation): found "
                                         f"{len(cluster.hosts)} ({', '.join(names)})"))
        if cluster.gateway is not None:
            problems.append((("gateway",), "a Slurm cluster's relay runs on the first node of "
                                           "its allocation (or, with relay_on: login, on its "
                                           "login node): remove `gateway`"))
        return problems

    def node_count(self, cluster: ClusterView) -> int:
        return slurm_request(cluster).nodes

    def process_count(self, cluster: ClusterView) -> int:
        request = slurm_request(cluster)
        return request.nodes * request.ntasks_per_node

    def allocated_hosts(self, cluster: ClusterView, nodes: dict[str, str]) -> list[HostSpec]:
        """The nodes, each with `ntasks_per_node` ranks."""
        slots = slurm_request(cluster).ntasks_per_node
        return [HostSpec(host=n, address=a, slots=slots) for n, a in nodes.items()]

    def rank_env(self, cluster: ClusterView, rank: int, local_rank: int) -> dict[str, str]:
        """The rank as a task of an ``srun --ntasks-per-node=N`` step: the ranks run inside
        their node's keeper, a step of one task per node, whose SLURM_PROCID (the node's index),
        SLURM_LOCALID (0) and SLURM_NTASKS (the node count) would mislead what reads them
        (scripts that take their rank from SLURM_PROCID, Lightning's SLURM environment,
        submitit)."""
        request = slurm_request(cluster)
        tasks = str(request.nodes * request.ntasks_per_node)
        return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local_rank),
                "SLURM_NTASKS": tasks, "SLURM_NPROCS": tasks, "SLURM_STEP_NUM_TASKS": tasks,
                "SLURM_NTASKS_PER_NODE": str(request.ntasks_per_node),
                "SLURM_TASKS_PER_NODE": f"{request.ntasks_per_node}(x{request.nodes})",
                "SLURM_STEP_TASKS_PER_NODE": f"{request.ntasks_per_node}(x{request.nodes})"}

    def checkpoint_host(self, cluster: ClusterView, host: HostSpec | int) -> str:
        """`node<i>`, the node's place in the allocation: a resumed job's new allocation, on
        whichever nodes, finds them (its nodes share the file system)."""
        index = host if isinstance(host, int) else cluster.hosts.index(host)
        return f"node{index}"

    def checkpoint_places(self, cluster: ClusterView, host: HostSpec) -> list[HostSpec | int]:
        return list(range(slurm_request(cluster).nodes))

    def summary(self, cluster: ClusterView) -> str:
        request = slurm_request(cluster)
        return (f"one Slurm job through {cluster.hosts[0].host}: {request.nodes} node(s) x "
                f"{request.ntasks_per_node} rank(s)")


    def node_memory(self, cluster: ClusterView) -> tuple[int, str] | None:
        return slurm_request(cluster).node_memory()


SCHEDULER = SlurmScheduler()
"""`scheduler: slurm` (`nebula_cli.schedulers.registry`)."""
