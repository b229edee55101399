"""validate --hosts with --params: whether each host holds the outer step of its processes
(the memory model: planner/outer_memory.py; what a host has: control/hostcheck.py's probe, or
for the nodes of an allocation what the spec asks of each, a Slurm `--mem`)."""

from __future__ import annotations

from nebula_cli.config.cluster import ClusterSpec
from nebula_cli.config.spec import JobSpec
from nebula_cli.control.hostcheck import HostCheck
from nebula_cli.planner.outer_memory import host_need, refusal


def memory_problems(spec: JobSpec, checks: list[HostCheck], params: int) -> list[str]:
    """One line per host that cannot hold the outer step of the ranks and relay it runs, with
    the bytes needed, the bytes it has, and the fixes; hosts whose memory is unknown pass."""
    found = {(c.cluster, c.host): c for c in checks}
    problems = []
    for cluster in spec.clusters:
        if cluster.login_host is not None:  # its nodes are not allocated yet: not probed
            problems += _allocated(cluster, params)
            continue
        ranks = cluster.process_count
        gateway = cluster.gateway_host.host if cluster.relay_host_known else None
        first = 0
        for host in cluster.hosts:
            check = found.get((cluster.name, host.host))
            need = host_need(params, ranks, host.slots, first, host.host == gateway)
            first += host.slots
            have = check.memory_bytes if check is not None else None
            if have is None:
                continue
            problem = refusal(f"{cluster.name}/{host.host}", need, have, params)
            if problem is not None:
                problems.append(problem)
    return problems


def _allocated(cluster: ClusterSpec, params: int) -> list[str]:
    """A cluster whose nodes come from an allocation: its first node (rank 0, and its relay
    unless that runs on the login node) against the memory the spec asks each node for (a
    Slurm `--mem`), when it asks for a fixed amount."""
    granted = cluster.scheduling.node_memory(cluster)
    if granted is None:
        return []
    have, said = granted
    per_node = cluster.process_count // max(1, cluster.scheduling.node_count(cluster))
    need = host_need(params, cluster.process_count, per_node, 0, cluster.relay_on != "login")
    problem = refusal(f"{cluster.name}/the allocation's first node ({said})", need, have,
                      params)
    return [] if problem is None else [problem]
