"""`RoleKind`: what a cluster's `role:` names, as the spec and the plan ask it (does it average,
does it serve soft labels, does it train), answered by the role, never by comparing its name.
Standard library only (the spec's models import it; the plan's roles, `JobRole`s in this
folder, take their relay services and `trains` from it)."""

from __future__ import annotations

import enum

from nebula_cli.config.roles.services import RelayService


class RoleKind(enum.Enum):
    """A job role by the name the spec gives it (`role: train`, `role: teacher`)."""

    TRAIN = "train"
    """The job's training: its clusters average their contributions through the relays."""
    TEACHER = "teacher"
    """Distillation: its clusters serve soft labels to the training clusters."""

    @property
    def relay_services(self) -> frozenset[RelayService]:
        """The relay services the role's clusters take part in."""
        return _SERVICES[self]

    @property
    def averages(self) -> bool:
        """Its clusters take part in the outer rounds (`RelayService.AVERAGE`)."""
        return RelayService.AVERAGE in self.relay_services

    @property
    def serves_labels(self) -> bool:
        """Its clusters serve soft labels (`RelayService.SOFT_LABELS`): a label relay each, a
        server (`run:` or the built-in one of `teacher:`), the job's `distill:`."""
        return RelayService.SOFT_LABELS in self.relay_services

    @property
    def trains(self) -> bool:
        """Its processes are the job's training: the job is done when they are. False: they
        serve the training and are ended by nebula once every training process has ended."""
        return self is RoleKind.TRAIN


_SERVICES = {RoleKind.TRAIN: frozenset({RelayService.AVERAGE}),
             RoleKind.TEACHER: frozenset({RelayService.SOFT_LABELS})}

ROLE_NAMES: tuple[str, ...] = tuple(kind.value for kind in RoleKind)
"""The spec's `role:` names, in its order."""
