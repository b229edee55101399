"""The state store's events stay bounded however long a job runs: the newest MAX_EVENTS are
kept, the launch and every resume always (attempts are counted from them), and the file stops
growing once the bound is reached."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from nebula_cli.control import state
from nebula_cli.control.state import StateStore


def test_events_are_bounded_and_launches_and_resumes_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "MAX_EVENTS", 60)  # the same code, a bound a test reaches fast
    monkeypatch.setattr(state, "PRUNE_EVERY", 10)
    with StateStore(tmp_path) as store:
        job = store.create_job("long", spec_path="/x.yaml", spec={"name": "long"})
        other = store.create_job("other", spec_path="/y.yaml", spec={"name": "other"})
        store.add_event(job.id, "launch", "launching long")
        store.add_event(other.id, "launch", "launching other")
        for i in range(3 * state.MAX_EVENTS):
            store.add_event(job.id, "host-state", f"worker restarting {i}", "east", "e1")
            if i % 15 == 0:
                store.add_event(job.id, "resume", f"resuming (attempt {i})")
        size_mid = _db_size(tmp_path / "state.db")
        for i in range(3 * state.MAX_EVENTS):
            store.add_event(job.id, "host-state", f"worker restarting again {i}", "east", "e1")
        events = store.events(job.id)
        assert len(events) <= state.MAX_EVENTS + state.PRUNE_EVERY + 13
        assert events[-1].message == f"worker restarting again {3 * state.MAX_EVENTS - 1}"
        assert store.count_events(job.id, "resume") == 12 and store.count_events(job.id,
                                                                                 "launch") == 1
        kept = [e.message for e in events if e.kind == "host-state"]
        assert kept == [f"worker restarting again {i}" for i in
                        range(3 * state.MAX_EVENTS - len(kept), 3 * state.MAX_EVENTS)]
        assert [e.message for e in store.events(other.id)] == ["launching other"]
        assert _db_size(tmp_path / "state.db") <= size_mid  # freed pages are used again


def _db_size(path: Path) -> int:
    """The database's size with its write-ahead log folded in."""
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path.stat().st_size
