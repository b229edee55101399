"""Schedulers as the spec and the plan see them (`config.schedulers`): the registry is the
spec's list of names, `none` takes the hosts as written, `slurm` the nodes of one allocation;
what a cluster may say follows from its scheduler, with the messages users have seen."""

from __future__ import annotations

import typing

import pytest

from nebula_cli.config.cluster import ClusterSpec
from nebula_cli.config.hosts import HostSpec
from nebula_cli.config.schedulers.registry import SCHEDULERS, scheduler_named
from nebula_cli.config.spec import parse_spec
from nebula_cli.errors import SpecError
from nebula_cli.schedulers.none.scheduler import NoScheduler
from nebula_cli.schedulers.slurm.scheduler import SlurmScheduler


def cluster(text: str) -> ClusterSpec:
    return parse_spec(f"name: j\nrun: x\nclusters:\n  - {text}\n").clusters[0]


def problems_of(text: str) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(f"name: j\nrun: x\nclusters:\n  - {text}\n")
    return {p.field or "": p.message for p in info.value.problems}


def test_the_registry_holds_the_names_the_spec_admits() -> None:
    names = typing.get_args(ClusterSpec.model_fields["scheduler"].annotation)
    assert set(names) == set(SCHEDULERS)
    assert all(scheduler_named(n).name == n for n in names)
    assert ClusterSpec.model_fields["scheduler"].default == NoScheduler.name
    with pytest.raises(ValueError, match="unknown scheduler 'pbs'; known: none, slurm"):
        scheduler_named("pbs")


def test_none_takes_the_hosts_as_written() -> None:
    c = cluster("{name: east, hosts: [{host: e1, slots: 2}, e2]}")
    assert isinstance(c.scheduling, NoScheduler) and not c.scheduling.allocates
    assert (c.node_count, c.process_count, c.login_host) == (2, 3, None)
    assert c.relay_host_known and c.scheduling.summary(c) is None
    assert [c.scheduling.checkpoint_host(c, h) for h in c.hosts] == ["e1", "e2"]
    assert c.scheduling.checkpoint_places(c, c.hosts[1]) == [c.hosts[1]]
    assert c.scheduling.allocated_hosts(c, {"n1": "a"}) == c.hosts  # nothing allocated


def test_slurm_runs_the_nodes_of_one_allocation_named_by_their_place() -> None:
    c = cluster("{name: hpc, hosts: [login], scheduler: slurm, "
                "slurm: {nodes: 2, ntasks_per_node: 4}}")
    s = c.scheduling
    assert isinstance(s, SlurmScheduler) and s.allocates and s.nodes_share_files
    assert (c.node_count, c.process_count, c.login_host) == (2, 8, c.hosts[0])
    assert not c.relay_host_known  # on the allocation's first node, not running yet
    assert s.summary(c) == "one Slurm job through login: 2 node(s) x 4 rank(s)"
    nodes = s.allocated_hosts(c, {"n7": "10.1.0.7", "n3": "10.1.0.3"})
    assert nodes == [HostSpec(host="n7", address="10.1.0.7", slots=4),
                     HostSpec(host="n3", address="10.1.0.3", slots=4)]
    running = c.with_nodes(nodes)
    assert running.login_host == c.hosts[0] and running.gateway_host.host == "n7"
    assert [s.checkpoint_host(running, h) for h in running.hosts] == ["node0", "node1"]
    assert s.checkpoint_places(c, c.hosts[0]) == [0, 1]  # seen from the login node
    on_login = cluster("{name: hpc, hosts: [login], scheduler: slurm, relay_on: login}")
    assert on_login.relay_host_known and on_login.gateway_host.host == "login"


@pytest.mark.parametrize("text, field, says", [
    ("{name: c, hosts: [a, b], scheduler: slurm}", "clusters[0].hosts",
     "a Slurm cluster has one host, its login node (the nodes come from the allocation): "
     "found 2 (a, b)"),
    ("{name: c, hosts: [a], gateway: a, scheduler: slurm}", "clusters[0].gateway",
     "remove `gateway`"),
    ("{name: c, hosts: [a], relay_on: login}", "clusters[0].relay_on",
     "relay_on: login is for Slurm clusters (scheduler: slurm); here the relay runs on the "
     "`gateway` host"),
    ("{name: c, hosts: [a], slurm: {nodes: 2}}", "clusters[0].slurm",
     "`slurm:` needs `scheduler: slurm` in this cluster"),
])
def test_what_a_cluster_may_say_follows_from_its_scheduler(text: str, field: str,
                                                            says: str) -> None:
    found = problems_of(text)
    assert list(found) == [field] and says in found[field], found


def test_a_pipeline_needs_hosts_known_before_launch() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec("name: j\nrun: x\nparallelism: {pipeline_stages: 2}\nclusters:\n"
                   "  - {name: hpc, hosts: [login], scheduler: slurm}\n")
    (problem,) = info.value.problems
    assert problem.field == "parallelism" and "cannot use a Slurm cluster yet" in str(problem)
