"""The allocators by scheduler name: exactly the schedulers that allocate have one."""

from __future__ import annotations

import pytest
from helpers.plan_defaults import minimal_spec

from nebula_cli.config.schedulers.registry import SCHEDULERS
from nebula_cli.errors import UsageError
from nebula_cli.scheduler.registry import ALLOCATORS, allocator_named, allocator_of


def test_every_allocating_scheduler_has_an_allocator_and_only_those() -> None:
    assert set(ALLOCATORS) == {n for n, s in SCHEDULERS.items() if s.allocates}
    assert all(a.name == n for n, a in ALLOCATORS.items())


def test_clusters_route_by_their_scheduler() -> None:
    spec = minimal_spec()
    plain = spec.clusters[0]
    assert plain.scheduler == "none" and allocator_of(plain) is None
    slurm = plain.model_copy(update={"scheduler": "slurm", "transport": "ssh"})
    assert allocator_of(slurm) is ALLOCATORS["slurm"]


def test_an_unknown_scheduler_in_a_record_is_refused_by_name() -> None:
    with pytest.raises(UsageError, match="scheduler 'pbs' is not available"):
        allocator_named("pbs")
