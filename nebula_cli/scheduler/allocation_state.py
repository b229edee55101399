"""`AllocationState`: what a scheduler says of an allocation, for `status` and for the job's
end (its workers are gone once it has ended)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AllocationState:
    """An allocation's state in the scheduler's words, and whether it has ended."""

    said: str
    """E.g. "Slurm job 12 RUNNING on n[1-2]" (the hosts' note, the reason of a lost one)."""
    ended: bool
    """It is over (TIMEOUT, PREEMPTED, CANCELLED, ...): its nodes and processes are gone."""

    def __str__(self) -> str:
        return self.said
