"""Whether the workers that should end with the same parameters did: every training worker of
the job, or in a pipelined job the replicas of each stage. Read from the workers' final
metrics records (``param_sha256``); the live view, `status` (text and ``--json``) and
`report` all say it from here, so that two parameter sets at the end are never a colour in
one view only (seen: a job SUCCEEDED with each cluster holding its own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nebula_cli.config.roles.registry import serving_clusters
from nebula_cli.control.state import JobRecord


@dataclass(frozen=True)
class ParameterVerdict:
    """The workers' final parameters compared."""

    workers: int
    """Final records compared (one per worker)."""
    sets: int
    """Distinct checksums among the workers that should agree (the most of any stage)."""
    unknown: int
    """Workers that gave no checksum."""
    stages: tuple[int, ...] | None
    """A pipelined job (each stage's replicas compared, not all workers): the stages whose
    replicas differ; None: not pipelined."""

    @property
    def identical(self) -> bool:
        return self.sets <= 1 and self.unknown == 0

    def sentence(self) -> str:
        """What the views print."""
        if self.identical:
            if self.stages is not None:
                return "each stage's replicas hold identical parameters"
            return f"all {self.workers} workers hold identical parameters"
        said = []
        if self.stages:
            said.append("the replicas of stage(s) "
                        f"{', '.join(map(str, self.stages))} hold different parameters")
        elif self.sets > 1:
            said.append(f"workers hold {self.sets} different parameter sets")
        if self.unknown:
            said.append(f"{self.unknown} of {self.workers} workers gave no checksum: their "
                        "parameters cannot be compared")
        return "; ".join(said)

    def to_json(self) -> dict[str, Any]:
        return {"identical": self.identical, "workers": self.workers, "sets": self.sets,
                "without_checksum": self.unknown,
                "stages_differing": None if self.stages is None else list(self.stages)}


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
            serving: frozenset[str]) -> ParameterVerdict | None:
    """The verdict on the final records ``finals`` (dicts with ``cluster``, ``param_sha256``
    and, in a pipelined job, ``stage``), leaving out the ``serving`` clusters (teachers: their
    parameters are their own) and workers that never synced across clusters
    (``cross_cluster_sync: false``: nothing to agree on). None when there is nothing to
    compare: no record has a checksum. Call it for a job that SUCCEEDED: a stopped or failed
    one ends before the clusters' final agreement."""
    finals = [f for f in finals
              if f.get("cluster") not in serving and f.get("cross_cluster_sync") is not False]
    shas = [f.get("param_sha256") for f in finals]
    if all(sha is None for sha in shas):
        return None
    staged = any("stage" in f for f in finals)
    groups: dict[Any, set[str]] = {}
    for f, sha in zip(finals, shas, strict=True):
        group = groups.setdefault(f.get("stage") if staged else None, set())
        if sha is not None:
            group.add(sha)
    return ParameterVerdict(
        workers=len(finals), sets=max(len(v) for v in groups.values()), unknown=shas.count(None),
        stages=tuple(sorted(k for k, v in groups.items() if len(v) > 1 and k is not None))
        if staged else None)


def of_job(job: JobRecord, finals: list[dict[str, Any]]) -> ParameterVerdict | None:
    """What every view says of a job's final parameters: the verdict on its workers' final
    records once it SUCCEEDED (its teachers left out), None before that or when it ended
    otherwise (stopped or failed before the clusters' final agreement)."""
    if job.state != "SUCCEEDED":
        return None
    return verdict(finals, serving_clusters(job.spec))
