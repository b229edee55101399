"""`RelayService`: what a cluster's relay does for the job on behalf of its role."""

from __future__ import annotations

import enum


class RelayService(enum.Enum):
    """A service a role's clusters take part in through their relays."""

    AVERAGE = "average"
    """The outer rounds: every training cluster's contribution averaged with its peers'."""
