"""The schedulers by name: the one place a cluster's `scheduler:` is routed.

A new scheduler (say Kubernetes) is its module here (a `Scheduler`), one line in `SCHEDULERS`,
its name in `ClusterSpec.scheduler`'s list (with its own section beside `slurm:` if it has
one), and, when it allocates hosts, its `Allocator` in `nebula_cli.scheduler.registry`.
"""

from __future__ import annotations

from nebula_cli.config.schedulers.base import Scheduler
from nebula_cli.schedulers.none.scheduler import NoScheduler
from nebula_cli.schedulers.slurm.scheduler import SlurmScheduler

SCHEDULERS: dict[str, Scheduler] = {s.name: s for s in (NoScheduler(), SlurmScheduler())}


def scheduler_named(name: str) -> Scheduler:
    """The scheduler a cluster's `scheduler:` names (the spec's model admits only these)."""
    try:
        return SCHEDULERS[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; known: "
                         f"{', '.join(sorted(SCHEDULERS))}") from None
