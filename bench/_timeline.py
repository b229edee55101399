"""Overlap's timeline in bench/wan_training.py: where an overlapped round's time went, from the
metrics records of rank 0 of each cluster (train.py writes one record per round)."""

from __future__ import annotations

from typing import Any

TIMELINE = ("boundary_s", "wait_s", "apply_s", "step_s_idle", "step_s_in_flight")


def timeline(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """Overlap's timeline, from the rank-0 records of every round: the mean seconds a round
    costs at its boundary (delta, hand-over), in waiting for its average and in applying it,
    and a step's mean seconds without a round in flight and with one (what the round's work
    on the same cores costs the steps beside it); ``merged_after_steps``: the mean steps
    between a boundary and its average's merge (how stale an applied average is: the loss with
    overlap depends on it, bench/diloco_schedule.py --modes overlap --tau N)."""
    rounds = [r for r in records if "wait_s" in r]
    if not rounds:
        return None
    starts = [r["boundary_s"] for r in records if "boundary_s" in r]
    out = {k: sum(r[k] for r in rounds if k in r) / max(1, sum(k in r for r in rounds))
           for k in TIMELINE[1:]}
    out["boundary_s"] = sum(starts) / max(1, len(starts))
    stale = [r["merged_after_steps"] for r in rounds if "merged_after_steps" in r]
    return {**{k: round(out[k], 4) for k in TIMELINE},
            **({"merged_after_steps": round(sum(stale) / len(stale), 2)} if stale else {})}
