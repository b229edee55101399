"""The job roles by name: the one place a cluster's role is routed.

A cluster's `role:` (`config/cluster.py`, its names those of `ROLES`) is read in `role_of`.
A new role is its module here (a `JobRole`), one line in `ROLES` and its name in the spec's
list.
"""

from __future__ import annotations

from typing import Any

from nebula_cli.config.roles.base import JobRole
from nebula_cli.config.roles.teacher import TeacherRole
from nebula_cli.config.roles.train import TrainRole
from nebula_cli.config.spec import ClusterSpec
from nebula_cli.errors import UsageError

ROLES: dict[str, JobRole] = {r.name: r for r in (TrainRole(), TeacherRole())}
DEFAULT_ROLE: str = ClusterSpec.model_fields["role"].default
"""What a cluster runs unless the spec says otherwise."""


def role_named(name: str) -> JobRole:
    """The role called `name`; UsageError naming the roles there are."""
    try:
        return ROLES[name]
    except KeyError:
        raise UsageError(f"unknown job role {name!r}; the roles are: "
                         f"{', '.join(sorted(ROLES))}") from None


def role_of(cluster: ClusterSpec) -> JobRole:
    """What `cluster` runs."""
    return role_named(cluster.role)


def serving_clusters(spec: dict[str, Any]) -> frozenset[str]:
    """The clusters of a recorded job's spec (its JSON form, as the state store keeps it)
    whose processes serve the training instead of training (`JobRole.trains` False)."""
    return frozenset(c["name"] for c in spec.get("clusters", [])
                     if not role_named(c.get("role") or DEFAULT_ROLE).trains)
