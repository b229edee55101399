"""`Allocation`: one cluster's allocation as submitted (and, once it runs, with its nodes), as
the job's local directory records it (`control.allocations`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nebula_cli.transport import Conn, conn_from_data

FIRST_SCHEDULER = "slurm"
"""The scheduler of records made before they named theirs (only Slurm allocated then)."""


@dataclasses.dataclass(frozen=True)
class Allocation:
    """What a scheduler holds for one cluster of a job."""

    cluster: str
    login: Conn
    """Where it was asked for (a Slurm cluster's login node): its state and its end too."""
    job: str
    """The scheduler's id of it (a Slurm job id)."""
    job_root: str
    """The job's directory on the cluster's shared file system."""
    nodes: dict[str, str] = dataclasses.field(default_factory=dict)
    """node name -> address, in the scheduler's order (the first is the cluster's master);
    empty until it runs."""
    scheduler: str = FIRST_SCHEDULER
    """The name of the scheduler (`nebula_cli.scheduler.registry`) that made it."""

    def to_data(self) -> dict[str, Any]:
        """Plain JSON data for the job's record."""
        return {"cluster": self.cluster, "login": self.login.to_data(), "job": self.job,
                "job_root": self.job_root, "nodes": dict(self.nodes),
                "scheduler": self.scheduler}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Allocation:
        """What `to_data` wrote, or a record of an earlier version (no "scheduler": Slurm)."""
        return cls(cluster=data["cluster"], login=conn_from_data(data["login"]),
                   job=str(data["job"]), job_root=data["job_root"],
                   nodes=dict(data.get("nodes") or {}),
                   scheduler=data.get("scheduler") or FIRST_SCHEDULER)
