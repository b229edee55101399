"""Whether the workers that should end with the same parameters did: every training worker of
the job, or in a pipelined job the replicas of each stage. Read from the workers' final
metrics records (``param_sha256``); the live view, `status` (text and ``--json``) and
`report` all say it from here, so that two parameter sets at the end are never a colour in
one view only (seen: a job SUCCEEDED with each cluster holding its own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParameterVerdict:
    """The workers' final parameters compared."""

    workers: int
    """Final records compared (one per worker)."""
    staged: bool
    """A pipelined job: each stage's replicas are compared, not all workers."""
    sets: int
    """Distinct checksums among the workers that should agree (the most of any stage)."""
    split: tuple[str, ...]
    """The groups whose workers differ: ("all",) or the stages, by number."""
    unknown: int
    """Workers that gave no checksum."""

    @property
    def identical(self) -> bool:
        return not self.split

    def sentence(self) -> str:
        """What the views print."""
        if self.identical:
            if self.staged:
                return "each stage's replicas hold identical parameters"
            return f"all {self.workers} workers hold identical parameters"
        if self.staged:
            return f"the replicas of stage(s) {', '.join(self.split)} hold different parameters"
        if self.unknown:
            return (f"workers hold {self.sets} different parameter sets "
                    f"({self.unknown} gave no checksum)")
        return f"workers hold {self.sets} different parameter sets"

    def to_json(self) -> dict[str, Any]:
        return {"identical": self.identical, "workers": self.workers, "sets": self.sets,
                "differing": list(self.split), "without_checksum": self.unknown}


def newest_finals(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each worker's newest final record among the workers' metrics ``records`` (in the order
    written: a job stopped and resumed has an earlier one per worker), in the order the
    workers first appear."""
    newest: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for r in records:
        if r.get("final"):
            newest[(r.get("cluster"), r.get("host"), r.get("rank"))] = r
    return list(newest.values())


def verdict(finals: list[dict[str, Any]],
            serving: frozenset[str] = frozenset()) -> ParameterVerdict | None:
    """The verdict on the final records ``finals`` (dicts with ``cluster``, ``param_sha256``
    and, in a pipelined job, ``stage``), leaving out the ``serving`` clusters (teachers: their
    parameters are their own). None when there is nothing to compare: no record has a
    checksum."""
    finals = [f for f in finals if f.get("cluster") not in serving]
    if all(f.get("param_sha256") is None for f in finals):
        return None
    staged = any("stage" in f for f in finals)
    groups: dict[Any, set[Any]] = {}
    for f in finals:
        groups.setdefault(f.get("stage") if staged else None, set()).add(f.get("param_sha256"))
    split = sorted((k for k, v in groups.items() if len(v) > 1 or None in v), key=str)
    return ParameterVerdict(
        workers=len(finals), staged=staged,
        sets=max(len(v - {None}) for v in groups.values()),
        split=tuple("all" if k is None else str(k) for k in split),
        unknown=sum(1 for f in finals if f.get("param_sha256") is None))
