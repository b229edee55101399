"""The allocators by scheduler name: where the control plane routes a cluster's scheduler.

Each is its package's `allocator.ALLOCATOR` (`nebula_cli.schedulers.registry`), named as the
scheduler whose hosts it allocates; a scheduler that allocates nothing has none.
"""

from __future__ import annotations

from nebula_cli.config.spec import ClusterSpec
from nebula_cli.errors import UsageError
from nebula_cli.scheduler.base import Allocator
from nebula_cli.schedulers.registry import parts

ALLOCATORS: dict[str, Allocator] = {m.ALLOCATOR.name: m.ALLOCATOR for m in parts("allocator")}


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
