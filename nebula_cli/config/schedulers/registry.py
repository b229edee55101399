"""The schedulers by name: the one place a cluster's `scheduler:` is routed.

Each is its package's `scheduler.SCHEDULER`, in the order `nebula_cli.schedulers.registry`
lists the packages (a new scheduler is its package and one line there): `SchedulerName`, the
spec's `scheduler:`, and the cluster's sections (`section_fields`) are made from them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from nebula_cli.config.schedulers.base import Scheduler
from nebula_cli.schedulers.registry import parts

SCHEDULERS: dict[str, Scheduler] = {m.SCHEDULER.name: m.SCHEDULER
                                    for m in parts("scheduler", required=True)}
SchedulerName = Literal[tuple(SCHEDULERS)]  # type: ignore[valid-type]
"""What a cluster's `scheduler:` may say."""


def section_fields() -> dict[str, Any]:
    """A field per scheduler with its own section (`slurm: SlurmSpec | None`), for the
    cluster's model (`config.cluster.ClusterSpec`)."""
    return {s.name: (s.section_model | None, Field(None, description=s.section_doc))
            for s in SCHEDULERS.values() if s.section_model is not None}


def scheduler_named(name: str) -> Scheduler:
    """The scheduler a cluster's `scheduler:` names (the spec's model admits only these)."""
    try:
        return SCHEDULERS[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; known: "
                         f"{', '.join(sorted(SCHEDULERS))}") from None
