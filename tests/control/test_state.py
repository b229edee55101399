"""The state store: schema, job ids, lookups and several processes at once."""

from __future__ import annotations

import multiprocessing as mp
import re
import sqlite3
from pathlib import Path

import pytest
from helpers.old_state import old_home

from nebula_cli.control import state
from nebula_cli.control.state import SCHEMA_VERSION, HostRecord, StateStore, new_job_id
from nebula_cli.errors import JobNotFound, NebulaError
from nebula_cli.schedulers.slurm.node_conn import SlurmNodeConn
from nebula_cli.transport.ssh.conn import SshConn

SPEC = {"name": "demo", "clusters": [{"name": "a", "hosts": [{"host": "h1"}]}]}


def test_job_id_is_readable() -> None:
    job_id = new_job_id("demo", 1_700_000_000)
    assert re.fullmatch(r"demo-\d{8}-\d{6}-[0-9a-f]{4}", job_id)


def test_create_get_and_lookup_by_prefix_and_name(tmp_path: Path) -> None:
    with StateStore(tmp_path) as store:
        job = store.create_job("demo", SPEC, "job.yaml")
        assert job.state == "PENDING" and job.clusters == ["a"] and job.num_hosts == 1
        assert store.get_job(job.id).id == job.id
        assert store.get_job(job.id[:-2]).id == job.id
        assert store.get_job("demo").id == job.id
        assert (tmp_path / "jobs" / job.id).is_dir()
        with pytest.raises(JobNotFound, match="no job 'nope'"):
            store.get_job("nope")
        store.create_job("demo", SPEC, None)
        with pytest.raises(JobNotFound, match="matches several jobs"):
            store.get_job("demo-")


def test_a_job_is_found_by_its_short_id_alone_or_after_its_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tables show a job's name and the id's last four hex digits; every command takes
    those (`get_job`), alone or as ``<name>-<short>``; one shared by two jobs is refused with
    both named, the name then tells them apart."""
    with StateStore(tmp_path) as store:
        job = store.create_job("demo", SPEC, "job.yaml")
        assert job.short_id == job.id[-4:] and re.fullmatch(r"[0-9a-f]{4}", job.short_id)
        assert store.get_job(job.short_id).id == job.id
        assert store.get_job(f"demo-{job.short_id}").id == job.id
        with pytest.raises(JobNotFound, match="no job 'other-"):
            store.get_job(f"other-{job.short_id}")
        monkeypatch.setattr(state.secrets, "token_hex", lambda n: job.short_id)
        twin = store.create_job("twin", SPEC, None)  # the same four digits
        assert twin.short_id == job.short_id
        with pytest.raises(JobNotFound, match=f"'{job.short_id}' matches several jobs"):
            store.get_job(job.short_id)
        assert store.get_job(f"twin-{job.short_id}").name == "twin"
        assert store.get_job(f"demo-{job.short_id}").id == job.id


def test_state_transitions_set_times(tmp_path: Path) -> None:
    with StateStore(tmp_path) as store:
        job = store.create_job("demo", SPEC, None)
        store.set_job_state(job.id, "RUNNING")
        running = store.get_job(job.id)
        assert running.started is not None and running.ended is None
        store.set_job_state(job.id, "FAILED", reason="a/h1 worker: rank 0 exit 3")
        failed = store.get_job(job.id)
        assert failed.ended is not None and failed.reason == "a/h1 worker: rank 0 exit 3"


def test_hosts_and_events_round_trip(tmp_path: Path) -> None:
    with StateStore(tmp_path) as store:
        job = store.create_job("demo", SPEC, None)
        rec = HostRecord(job.id, "a", "h1", "worker", 0, 2, "/x", "RUNNING", pid=10,
                         detail={"logs": {"0": "logs/rank0.log"}})
        store.upsert_host(rec)
        rec.state, rec.exit_code = "FAILED", -9
        store.upsert_host(rec)
        (got,) = store.hosts(job.id)
        assert (got.state, got.exit_code, got.pid, got.detail["logs"]) == (
            "FAILED", -9, 10, {"0": "logs/rank0.log"})
        store.add_event(job.id, "state", "first", cluster="a", host="h1")
        store.add_event(job.id, "state", "second")
        events = store.events(job.id)
        assert [e.message for e in events] == ["first", "second"]
        assert [e.message for e in store.events(job.id, after_id=events[0].id)] == ["second"]


def test_a_host_recorded_before_typed_connections_is_reached_as_then(tmp_path: Path) -> None:
    """detail["conn"] stays the plain data earlier versions wrote; it reads back typed."""
    login = {"transport": "ssh", "name": "login", "host": "login", "user": "jdoe",
             "port": 2222, "key": None, "jump": None, "python": "python3"}
    node = {"transport": "slurm-node", "name": "n1", "login": login, "job": "12",
            "node": "n1", "address": "10.1.0.1", "keeper": "12", "python": "python3",
            "pythonpath": "/home/jdoe/.nebula/jobs/j/lib"}
    with StateStore(tmp_path) as store:
        job = store.create_job("demo", SPEC, None)
        for host, conn in (("login", login), ("n1", node)):
            store.upsert_host(HostRecord(job.id, "a", host, "worker", 0, 1, "/x", "RUNNING",
                                         detail={"conn": conn}))
    with StateStore(tmp_path) as store:
        got = {rec.host: rec for rec in store.hosts(job.id)}
    assert isinstance(got["login"].conn, SshConn) and got["login"].conn.port == 2222
    assert isinstance(got["n1"].conn, SlurmNodeConn) and got["n1"].conn.login == got[
        "login"].conn
    assert got["n1"].conn.in_allocation and not got["login"].conn.in_allocation
    assert (got["login"].conn.to_data(), got["n1"].conn.to_data()) == (login, node)
    assert got["n1"].detail["conn"] == node  # the store keeps what it was given


def test_a_state_db_of_the_previous_version_reads_with_its_allocations_notes(
        tmp_path: Path) -> None:
    """A Slurm node's note, stored under detail["slurm"] (the allocator's name), and its
    connection, as commit 1b4814b stored them, read back through the record."""
    with StateStore(old_home(tmp_path / "home")) as store:
        (job,) = store.list_jobs()
        got = {rec.host: rec for rec in store.hosts(job.id)}
    assert job.state == "RUNNING" and sorted(got) == ["login", "n1", "n2"]
    for node in ("n1", "n2"):
        conn = got[node].conn
        assert isinstance(conn, SlurmNodeConn) and conn.in_allocation
        assert (conn.allocator, conn.node, conn.login) == ("slurm", node, got["login"].conn)
        assert got[node].allocation_said == "Slurm job 12 RUNNING on n[1-2]"
    assert got["login"].allocation_said is None and not got["login"].conn.in_allocation
    assert HostRecord(job.id, "hpc", "h", "worker", 0, 1, "/x", "RUNNING").allocation_said \
        is None  # a record without a connection (none of any version) has no note


def test_schema_is_versioned_and_a_newer_schema_is_refused(tmp_path: Path) -> None:
    with StateStore(tmp_path) as store:
        assert store.schema_version == SCHEMA_VERSION
    db = sqlite3.connect(tmp_path / "state.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(NebulaError, match="newer than this nebula"):
        StateStore(tmp_path)


def _writer(home: str, n: int, out: mp.Queue) -> None:
    try:
        with StateStore(Path(home)) as store:
            for i in range(n):
                job = store.create_job("w", SPEC, None)
                store.set_job_state(job.id, "RUNNING")
                store.upsert_host(HostRecord(job.id, "a", "h1", "worker", 0, 1, "/x", "RUNNING"))
                store.add_event(job.id, "tick", str(i))
        out.put("ok")
    except Exception as exc:  # reported to the test
        out.put(repr(exc))


def _reader(home: str, n: int, out: mp.Queue) -> None:
    try:
        with StateStore(Path(home)) as store:
            for _ in range(n):
                for job in store.list_jobs():
                    store.hosts(job.id)
                    store.events(job.id)
        out.put("ok")
    except Exception as exc:
        out.put(repr(exc))


def test_concurrent_writers_and_readers_never_see_locks(tmp_path: Path) -> None:
    StateStore(tmp_path).close()
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), 25, out)) for _ in range(3)]
    procs += [ctx.Process(target=_reader, args=(str(tmp_path), 40, out)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results == ["ok"] * len(procs)
    with StateStore(tmp_path) as store:
        assert len(store.list_jobs()) == 75


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_home_database_and_job_dirs_are_private(tmp_path: Path) -> None:
    home = tmp_path / "fresh" / "home"
    with StateStore(home) as store:
        job = store.create_job("demo", {**SPEC, "env": {"API_TOKEN": "s3cret"}}, None)
        store.add_event(job.id, "x", "a write, so that the WAL exists")
        wal, shm = home / "state.db-wal", home / "state.db-shm"
        assert wal.exists() and shm.exists()
        assert _mode(home) == _mode(home / "jobs") == _mode(store.job_dir(job.id)) == 0o700
        assert _mode(home / "state.db") == _mode(wal) == _mode(shm) == 0o600


def test_a_loose_home_is_tightened_with_one_warning(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    home = tmp_path / "home"
    with StateStore(home) as store:
        job = store.create_job("demo", SPEC, None)
        store.add_event(job.id, "x", "y")
    old_job = home / "jobs" / job.id
    for path, mode in [(home, 0o755), (home / "jobs", 0o775), (old_job, 0o777),
                       (home / "state.db", 0o644)]:
        path.chmod(mode)
    with caplog.at_level("WARNING", logger="nebula.state"), StateStore(home) as store:
        assert store.get_job(job.id).id == job.id
    warnings = [r.getMessage() for r in caplog.records if r.name == "nebula.state"]
    assert len(warnings) == 1 and str(home) in warnings[0] and "0755->0700" in warnings[0]
    assert "state.db 0644->0600" in warnings[0]
    assert _mode(home) == _mode(home / "jobs") == _mode(old_job) == 0o700
    assert _mode(home / "state.db") == 0o600
    caplog.clear()
    with caplog.at_level("WARNING", logger="nebula.state"), StateStore(home):
        pass
    assert not [r for r in caplog.records if r.name == "nebula.state"]  # said once


def test_a_worker_between_a_failure_and_its_restart_keeps_the_job_running() -> None:
    from nebula_cli.control.jobs import JobSnapshot, job_state

    hosts = [HostRecord("j", c, "h", "worker", 0, 1, "/d", state)
             for c, state in (("east", "SUCCEEDED"), ("west", "RESTARTING"))]
    assert job_state(hosts, "RUNNING") == "RUNNING"  # not SUCCEEDED while west restarts
    assert JobSnapshot(job=None, hosts=hosts).active  # type: ignore[arg-type]
    hosts[1].state = "SUCCEEDED"
    assert job_state(hosts, "RUNNING") == "SUCCEEDED"
