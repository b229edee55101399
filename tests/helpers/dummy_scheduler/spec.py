"""The `dummy:` section of a cluster of the skeleton scheduler."""

from __future__ import annotations

from pydantic import Field

from nebula_cli.config.sections import SpecModel


class DummySpec(SpecModel):
    """What to ask the dummy scheduler for."""

    pods: int = Field(2, ge=1, le=8)
    """Pods, one rank each."""
