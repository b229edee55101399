"""`RelayService`: what a cluster's relay does for the job on behalf of its role."""

from __future__ import annotations

import enum


class RelayService(enum.Enum):
    """A service a role's clusters take part in through their relays."""

    AVERAGE = "average"
    """The outer rounds: every training cluster's contribution averaged with its peers'."""
    SOFT_LABELS = "soft_labels"
    """Distillation: a teacher cluster's label relay answers the training clusters' requests
    (token ids in, sparse soft labels out; `nebula_cli.relay.distill`)."""
