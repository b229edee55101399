"""A job with a teacher cluster ends when its training does: `JobOps` ends the relays and the
teacher's workers (which serve until told to stop) once every training worker has ended, and
`job_state` decides by the training workers, so a teacher ended by nebula leaves the job
SUCCEEDED. The real path: tests/e2e/test_distill_launch.py."""

from __future__ import annotations

from pathlib import Path

from nebula_cli.control.jobs import JobOps, job_state
from nebula_cli.control.session import Session
from nebula_cli.control.state import HostRecord, StateStore

TEACHER = frozenset({"lab"})


def hosts(student: str, teacher: str = "RUNNING", relay: str = "RUNNING") -> list[HostRecord]:
    return [HostRecord("j", "cloud", "c1", "worker", 0, 2, "/c", student),
            HostRecord("j", "cloud", "c1", "relay", 0, 1, "/r", relay),
            HostRecord("j", "lab", "l1", "worker", 0, 1, "/l", teacher)]


def test_a_teacher_ended_after_the_students_leaves_the_job_succeeded() -> None:
    ended = hosts("SUCCEEDED", teacher="STOPPED", relay="STOPPED")
    assert job_state(ended, "RUNNING", servers=TEACHER) == "SUCCEEDED"
    assert job_state(hosts("SUCCEEDED"), "RUNNING", servers=TEACHER) == "RUNNING"
    stopped = hosts("STOPPED", teacher="STOPPED", relay="STOPPED")  # `nebula stop`
    assert job_state(stopped, "RUNNING", servers=TEACHER) == "STOPPED"
    # a teacher that failed for good: its hosts say FAILED, the job follows its students
    failed = hosts("SUCCEEDED", teacher="FAILED", relay="STOPPED")
    assert job_state(failed, "RUNNING", servers=TEACHER) == "SUCCEEDED"
    assert job_state(hosts("RUNNING", teacher="LOST"), "RUNNING", servers=TEACHER) == "RUNNING"
    student_failed = hosts("FAILED", teacher="STOPPED", relay="STOPPED")
    assert job_state(student_failed, "RUNNING", servers=TEACHER) == "FAILED"
    # a cluster that is no server counts as training: its stopped worker stops the job
    assert job_state(ended, "RUNNING") == "STOPPED"


class Recorded(JobOps):
    """`JobOps` whose agents are not asked: the stops it would send are recorded."""

    def __init__(self, store: StateStore) -> None:
        super().__init__(Session(store))
        self.stopped: list[tuple[list[tuple[str, str]], str]] = []
        self.left: list[tuple[str, str]] = []  # stopped as leaving the job for good

    def _stop_recs(self, recs: list[HostRecord], reason: str, grace: float | None,
                   leave: bool = False) -> None:
        self.stopped.append(([(r.cluster, r.role) for r in recs], reason))
        self.left += [(r.cluster, r.role) for r in recs] if leave else []

    def _sweep_recs(self, recs: list[HostRecord]) -> None:
        self.stopped.append(([(r.cluster, r.role) for r in recs], "swept"))


def test_the_teacher_and_the_relays_are_ended_once_every_student_has(tmp_path: Path) -> None:
    with StateStore(tmp_path) as store:
        ops = Recorded(store)
        assert not ops._end_idle_services(hosts("RUNNING"), TEACHER)
        assert not ops._end_idle_services(hosts("RESTARTING"), TEACHER)
        assert ops.stopped == []
        assert ops._end_idle_services(hosts("SUCCEEDED"), TEACHER)
        assert ops.stopped == [([("cloud", "relay"), ("lab", "worker")],
                                "ended after the training finished")]
        ops.stopped.clear()  # an ended teacher is not stopped again
        assert ops._end_idle_services(hosts("FAILED", teacher="STOPPED"), TEACHER)
        assert ops.stopped == [([("cloud", "relay")], "ended after the training finished")]
        ops.stopped.clear()
        assert not ops._end_idle_services(
            hosts("SUCCEEDED", teacher="STOPPED", relay="STOPPED"), TEACHER)
        assert ops.stopped == []


def test_a_teacher_failed_for_good_ends_its_cluster_alone(tmp_path: Path) -> None:
    """The students go on (their loader follows `when_no_teacher`); the event says why."""
    with StateStore(tmp_path) as store:
        ops = Recorded(store)
        job = store.create_job("j", {"name": "j"}, None).id
        two_ranks = [*hosts("RUNNING", teacher="FAILED"),
                     HostRecord("j", "lab", "l2", "worker", 1, 1, "/l2", "RUNNING")]
        for rec in two_ranks:
            rec.job_id = job
            store.upsert_host(rec)
        assert ops._end_after_failure(two_ranks, None, TEACHER)
        (stopped, why), swept = ops.stopped
        assert stopped == [("lab", "worker")] and swept == ([("lab", "worker")], "swept")
        assert why.startswith("teacher cluster(s) lab lost (lab/l1 failed)")
        assert "distill.when_no_teacher" in why
        ops.stopped.clear()  # nothing of the students is touched; a teacher ended stays so
        ended = [*hosts("RUNNING", teacher="FAILED"),
                 HostRecord(job, "lab", "l2", "worker", 1, 1, "/l2", "STOPPED")]
        for rec in ended:
            rec.job_id = job
        assert not ops._end_after_failure(ended, None, TEACHER)
        assert ops.stopped == []
        # without the teacher known as a server, its failure ends the whole job, as before
        assert ops._end_after_failure(ended, None)
        assert ("cloud", "worker") in ops.stopped[0][0]


def test_a_cluster_dropped_under_min_clusters_leaves_and_a_failed_job_just_stops(
        tmp_path: Path) -> None:
    """Under `min_clusters` the lost cluster's relay is stopped as leaving the job (its peers
    do not wait for it at the end); when the whole job fails, every relay is only stopped."""
    with StateStore(tmp_path) as store:
        ops = Recorded(store)
        job = store.create_job("j", {"name": "j"}, None).id
        recs = [HostRecord(job, "west", "w1", "worker", 0, 1, "/w", "FAILED"),
                HostRecord(job, "west", "w1", "relay", 0, 1, "/wr", "RUNNING"),
                HostRecord(job, "east", "e1", "worker", 0, 1, "/e", "RUNNING"),
                HostRecord(job, "east", "e1", "relay", 0, 1, "/er", "RUNNING")]
        for rec in recs:
            store.upsert_host(rec)
        assert ops._end_after_failure(recs, 1)
        assert ops.left == [("west", "relay")]
        assert all(c == "west" for stopped, _ in ops.stopped[:2] for c, _ in stopped)
        ops.stopped.clear()
        ops.left.clear()
        assert ops._end_after_failure(recs, None)  # no min_clusters: the job fails whole
        assert ops.left == [] and ("east", "relay") in ops.stopped[1][0]
