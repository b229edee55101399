"""`JobRole`: what a cluster runs. Every cluster trains today (`train`); the distillation
issue adds a teacher (serving soft labels through the relays) as another implementation."""

from __future__ import annotations

from typing import Protocol

from nebula_cli.config.roles.kind import RoleKind
from nebula_cli.config.roles.services import RelayService
from nebula_cli.config.roles.worker_host import WorkerHost


class JobRole(Protocol):
    """A role's worker processes on one host (stateless; one instance per name)."""

    kind: RoleKind
    """What the spec's `role:` names, which answers what the spec and the plan ask of it."""
    name: str
    """What names the role (issue 24's spec field `role:`): its kind's value."""
    relay_services: frozenset[RelayService]
    """The relay services the role's clusters take part in."""
    trains: bool
    """Whether the role's processes are the job's training: the job is done when they are.
    False: they serve the training (a teacher runs until told to stop) and, like the relays,
    are ended by nebula once every training process has ended."""

    def command(self, at: WorkerHost) -> list[str]:
        """The argv of each of the host's worker processes."""
        ...

    def environment(self, at: WorkerHost, env: dict[str, str]) -> dict[str, str]:
        """The host's processes' environment (`env`: the world's, the spec's, nebula's), with
        what the role adds."""
        ...

    def files(self, at: WorkerHost) -> tuple[dict[str, str], dict[str, bytes]]:
        """The role's files beside agent.json (relative to the agent's directory) and the
        environment variables that name them to the processes."""
        ...
