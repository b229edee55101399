"""The job roles by name: the one place a cluster's role is routed.

Every cluster trains until the spec names roles (the distillation issue adds `role:` to a
cluster, read in `role_of`). A new role is its module here (a `JobRole`) and one line in
`ROLES`.
"""

from __future__ import annotations

from nebula_cli.config.roles.base import JobRole
from nebula_cli.config.roles.train import TrainRole
from nebula_cli.config.spec import ClusterSpec
from nebula_cli.errors import UsageError

ROLES: dict[str, JobRole] = {r.name: r for r in (TrainRole(),)}
DEFAULT_ROLE = "train"
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
    return role_named(DEFAULT_ROLE)
