"""The allocators by scheduler name: where the control plane routes a cluster's scheduler.

Names are those of `config.schedulers.registry` whose scheduler allocates; a new one (say
Kubernetes) is its module here (an `Allocator`) and one line in `ALLOCATORS`.
"""

from __future__ import annotations

from nebula_cli.config.spec import ClusterSpec
from nebula_cli.errors import UsageError
from nebula_cli.scheduler.base import Allocator
from nebula_cli.schedulers.slurm.allocator import SlurmAllocator

ALLOCATORS: dict[str, Allocator] = {a.name: a for a in (SlurmAllocator(),)}


def allocator_named(name: str) -> Allocator:
    """The allocator of the scheduler called `name` (as a job's record names it)."""
    try:
        return ALLOCATORS[name]
    except KeyError:
        raise UsageError(f"scheduler '{name}' is not available in this version of nebula") \
            from None


def allocator_of(cluster: ClusterSpec) -> Allocator | None:
    """The allocator of the cluster's scheduler; None when its hosts are the spec's."""
    return allocator_named(cluster.scheduler) if cluster.scheduling.allocates else None
