"""control/final_parameters.py: the workers' final checksums compared, as every view says it."""

from __future__ import annotations

from typing import Any

from nebula_cli.control.final_parameters import newest_finals, of_job, verdict
from nebula_cli.control.state import JobRecord

NONE: frozenset[str] = frozenset()


def fin(cluster: str, rank: int, sha: str | None, **kw: object) -> dict:
    return {"cluster": cluster, "host": f"{cluster[0]}1", "rank": rank, "final": True,
            "param_sha256": sha, **kw}


def test_workers_that_agree_and_workers_that_do_not() -> None:
    same = verdict([fin("east", 0, "a"), fin("west", 0, "a")], NONE)
    assert same is not None and same.identical and same.sets == 1
    assert same.sentence() == "all 2 workers hold identical parameters"
    split = verdict([fin("east", 0, "a"), fin("east", 1, "a"), fin("west", 0, "b")], NONE)
    assert split is not None and not split.identical and split.sets == 2
    assert split.sentence() == "workers hold 2 different parameter sets"
    assert split.to_json() == {"identical": False, "workers": 3, "sets": 2,
                               "without_checksum": 0, "stages_differing": None}


def test_a_worker_without_a_checksum_is_not_taken_for_agreement() -> None:
    said = verdict([fin("east", 0, "a"), fin("west", 0, None)], NONE)
    assert said is not None and not said.identical and said.sets == 1
    assert said.sentence() == ("1 of 2 workers gave no checksum: their parameters cannot be "
                               "compared")
    assert verdict([fin("east", 0, None)], NONE) is None  # nothing to compare


def test_stages_are_compared_replica_to_replica_teachers_and_unsynced_workers_not_at_all(
        ) -> None:
    staged = [fin("east", 0, "s0", stage=0), fin("east", 1, "s1", stage=1),
              fin("west", 0, "s0", stage=0), fin("west", 1, "other", stage=1)]
    said = verdict(staged, NONE)
    assert said is not None and said.stages == (1,) and not said.identical
    assert said.sentence() == "the replicas of stage(s) 1 hold different parameters"
    assert said.to_json()["stages_differing"] == [1]
    taught = [fin("student", 0, "a"), fin("student", 1, "a"), fin("teacher", 0, "t")]
    said = verdict(taught, frozenset({"teacher"}))
    assert said is not None and said.identical and said.workers == 2
    alone = [fin("east", 0, "a"), fin("west", 0, "b", cross_cluster_sync=False)]
    said = verdict(alone, NONE)  # west never synced: nothing for it to agree on
    assert said is not None and said.identical and said.workers == 1


def test_each_workers_newest_final_record_counts() -> None:
    """A job stopped and resumed: the stop's final records are older than the end's."""
    records = [fin("east", 0, "old"), fin("west", 0, "old2"), fin("east", 0, "new"),
               {"cluster": "west", "rank": 0, "step": 9}, fin("west", 0, "new")]
    newest = newest_finals(records)
    assert [(f["cluster"], f["param_sha256"]) for f in newest] == [("east", "new"),
                                                                  ("west", "new")]
    said = verdict(newest, NONE)
    assert said is not None and said.identical


def job(state: str, spec: dict[str, Any] | None = None) -> JobRecord:
    return JobRecord(id="j1", name="j", spec_path=None, spec=spec or {"clusters": []},
                     state=state, created=0.0, started=0.0, ended=None, reason=None)


def test_a_verdict_only_for_a_job_that_succeeded() -> None:
    """A stopped or failed job ended before the clusters' final agreement: its workers'
    differing parameters are no news, and no red line is printed for them."""
    finals = [fin("east", 0, "a"), fin("west", 0, "b")]
    said = of_job(job("SUCCEEDED"), finals)
    assert said is not None and not said.identical
    for state in ("STOPPED", "FAILED", "RUNNING"):
        assert of_job(job(state), finals) is None
