"""StateStore: jobs, clusters, hosts and events in sqlite (WAL) under $NEBULA_HOME.

$NEBULA_HOME holds job specs with their `env` (often secrets) and each job's CA key, so it is
private: the home and every job directory 0700, `state.db` and its -wal/-shm 0600. A home made
with looser modes (by an older nebula, or by hand) is tightened when a store opens it, once, with
a warning that says what was changed.

Several nebula commands may run at once (a `launch` writing while two `status` read). WAL mode
lets readers proceed while one writer writes; a generous busy timeout plus BEGIN IMMEDIATE for
writes means a second writer waits instead of failing with "database is locked".

A job's events are bounded (`MAX_EVENTS`, the launch and resumes always kept), so that a
month-long run's store does not grow with its restarts; SQLite reuses the pages freed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from nebula_cli.errors import JobNotFound, NebulaError
from nebula_cli.transport import Conn, conn_from_data

log = logging.getLogger("nebula.state")
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600

BUSY_TIMEOUT_MS = 30_000

# Each entry migrates the schema from version i to i+1. Never edit a released entry: append.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        spec_path TEXT,
        spec_json TEXT NOT NULL,
        state TEXT NOT NULL,
        created REAL NOT NULL,
        started REAL,
        ended REAL,
        reason TEXT
    );
    CREATE TABLE clusters (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        transport TEXT NOT NULL,
        gateway TEXT,
        PRIMARY KEY (job_id, name)
    );
    CREATE TABLE hosts (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        cluster TEXT NOT NULL,
        host TEXT NOT NULL,
        role TEXT NOT NULL,
        node_rank INTEGER NOT NULL,
        slots INTEGER NOT NULL,
        agent_dir TEXT NOT NULL,
        state TEXT NOT NULL,
        pid INTEGER,
        pgid INTEGER,
        exit_code INTEGER,
        restarts INTEGER NOT NULL DEFAULT 0,
        updated REAL NOT NULL,
        detail TEXT,
        PRIMARY KEY (job_id, cluster, host, role)
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        ts REAL NOT NULL,
        cluster TEXT,
        host TEXT,
        kind TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE INDEX events_job ON events(job_id, id);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)

# Job and process states. A process is PENDING until its agent runs it, then RUNNING, and ends
# SUCCEEDED, FAILED or STOPPED (RESTARTING between a failure and its restart). LOST: its agent
# vanished without recording an end.
ACTIVE_STATES = frozenset({"PENDING", "QUEUED", "STARTING", "RUNNING", "RESTARTING", "STOPPING"})
END_STATES = frozenset({"SUCCEEDED", "FAILED", "STOPPED", "LOST", "CANCELLED"})


def nebula_home() -> Path:
    """$NEBULA_HOME, default ~/.nebula."""
    return Path(os.environ.get("NEBULA_HOME") or Path.home() / ".nebula").expanduser()


def new_job_id(name: str, now: float | None = None) -> str:
    """A readable job id: `<name>-<yyyymmdd>-<hhmmss>-<4 hex>` (local time)."""
    stamp = datetime.fromtimestamp(now if now is not None else time.time())
    return f"{name}-{stamp:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


SHORT_REF = re.compile(r"(?:(?P<name>.+)-)?(?P<short>[0-9a-f]{4})")
"""A job's short reference: its id's last four hex digits, alone or after its name
(``24ff``, ``quickstart-24ff``)."""


def short_id(job_id: str) -> str:
    """The last part of a job id (`new_job_id`'s four hex digits): what tables show."""
    return job_id.rsplit("-", 1)[-1]


MAX_EVENTS = 2000
"""Events kept per job (the newest; `StateStore.add_event` prunes older ones)."""
PRUNE_EVERY = 100
"""A job's events are pruned back to MAX_EVENTS once they exceed it by this many."""
KEPT_EVENTS = ("launch", "resume")
"""Event kinds never pruned: the launch, and each resume (`count_events` numbers attempts)."""

ROTATED_KEY = "rotated"
"""A host record's detail: the rotated files kept per log and metrics file (`rotated_kept`)."""


@dataclass
class HostRecord:
    """One supervised process role (worker or relay) on one host, as last seen."""

    job_id: str
    cluster: str
    host: str
    role: str
    node_rank: int
    slots: int
    agent_dir: str
    state: str
    pid: int | None = None
    pgid: int | None = None
    exit_code: int | None = None
    restarts: int = 0
    updated: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def conn(self) -> Conn:
        """How to reach the host: ``detail["conn"]``, kept as plain data (as every version of
        nebula wrote it), read back typed."""
        return conn_from_data(self.detail["conn"])

    @property
    def allocation_said(self) -> str | None:
        """What the scheduler of the host's allocation last said of it (`status`' note), kept
        under that scheduler's allocator's name (``detail["slurm"]``, as every version wrote
        it); None for a host of no allocation."""
        key = self.conn.allocator if "conn" in self.detail else None
        said = self.detail.get(key) if key else None
        return said if isinstance(said, str) else None

    @property
    def rotated_kept(self) -> int:
        """How many rotated files each of its logs and metrics files may have
        (``detail["rotated"]``, the spec's ``logs.keep``; 0 for jobs of earlier versions)."""
        kept = self.detail.get(ROTATED_KEY)
        return kept if isinstance(kept, int) and kept >= 0 else 0


@dataclass
class JobRecord:
    id: str
    name: str
    spec_path: str | None
    spec: dict[str, Any]
    state: str
    created: float
    started: float | None
    ended: float | None
    reason: str | None

    @property
    def clusters(self) -> list[str]:
        return [c["name"] for c in self.spec.get("clusters", [])]

    @property
    def num_hosts(self) -> int:
        return sum(len(c.get("hosts", [])) for c in self.spec.get("clusters", []))

    @property
    def short_id(self) -> str:
        """What tables show of the id; every command takes it (`StateStore.get_job`)."""
        return short_id(self.id)


@dataclass
class Event:
    id: int
    job_id: str
    ts: float
    cluster: str | None
    host: str | None
    kind: str
    message: str


class StateStore:
    """The local state database. Open it, use it, close it (or use it as a context manager)."""

    def __init__(self, home: Path | None = None) -> None:
        self.home = (home or nebula_home()).expanduser()
        self.path = self.home / "state.db"
        try:
            self.home.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
            (self.home / "jobs").mkdir(mode=PRIVATE_DIR, exist_ok=True)
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, PRIVATE_FILE))
        except OSError as exc:
            raise NebulaError(f"cannot create nebula's home {self.home}: {exc}") from exc
        try:
            self._db = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None
            )
            self._db.row_factory = sqlite3.Row
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        except sqlite3.Error as exc:
            raise NebulaError(f"cannot open the state database {self.path}: {exc}") from exc
        self._tighten()

    def _tighten(self) -> None:
        """Make the home, the job directories and the database private; warn once if they were
        not (sqlite makes -wal/-shm with the database's mode, so they follow)."""
        jobs = self.home / "jobs"
        wanted = [(self.home, PRIVATE_DIR), (jobs, PRIVATE_DIR)]
        wanted += [(d, PRIVATE_DIR) for d in jobs.iterdir() if d.is_dir() and not d.is_symlink()]
        wanted += [(self.home / f"state.db{suffix}", PRIVATE_FILE)
                   for suffix in ("", "-wal", "-shm", "-journal")]
        changed = []
        for path, mode in wanted:
            try:
                found = path.lstat().st_mode & 0o777
                if found & ~mode:
                    path.chmod(mode)
                    changed.append(f"{path.name} {found:04o}->{mode:04o}")
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise NebulaError(f"cannot make {path} private ({exc}); it holds job specs and "
                                  f"keys: fix its owner or mode by hand") from exc
        if changed:
            log.warning("nebula's home %s was readable by others; made it private: %s",
                        self.home, ", ".join(changed))

    # -- plumbing -------------------------------------------------------------------------
    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _migrate(self) -> None:
        with self._write() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise NebulaError(
                    f"{self.path} has schema version {version}, newer than this nebula "
                    f"understands ({SCHEMA_VERSION}); upgrade nebula"
                )
            for step in MIGRATIONS[version:]:
                for statement in step.split(";"):
                    if statement.strip():
                        db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def job_dir(self, job_id: str) -> Path:
        return self.home / "jobs" / job_id

    # -- jobs -----------------------------------------------------------------------------
    def create_job(self, name: str, spec: dict[str, Any], spec_path: str | None) -> JobRecord:
        """Record a new job (state PENDING) and make its directory."""
        now = time.time()
        with self._write() as db:
            while True:
                job_id = new_job_id(name, now)
                exists = db.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone()
                if not exists:
                    break
            db.execute(
                "INSERT INTO jobs (id, name, spec_path, spec_json, state, created)"
                " VALUES (?, ?, ?, ?, 'PENDING', ?)",
                (job_id, name, spec_path, json.dumps(spec), now),
            )
            for cluster in spec.get("clusters", []):
                db.execute(
                    "INSERT INTO clusters (job_id, name, transport, gateway) VALUES (?, ?, ?, ?)",
                    (job_id, cluster["name"], cluster.get("transport", "ssh"),
                     cluster.get("gateway")),
                )
        self.job_dir(job_id).mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        self.job_dir(job_id).chmod(PRIVATE_DIR)  # mkdir's mode is cut by the umask
        return self.get_job(job_id)

    def set_job_state(
        self, job_id: str, state: str, reason: str | None = None, at: float | None = None
    ) -> None:
        """Record a job's new state; `at` is when it happened (default now)."""
        now = at if at is not None else time.time()
        with self._write() as db:
            db.execute(
                "UPDATE jobs SET state = ?,"
                " started = CASE WHEN ? = 'RUNNING' AND started IS NULL THEN ? ELSE started END,"
                " ended = CASE WHEN ? IN ('SUCCEEDED','FAILED','STOPPED')"
                "   THEN COALESCE(ended, ?) ELSE NULL END,"
                " reason = COALESCE(?, reason) WHERE id = ?",
                (state, state, now, state, now, reason, job_id),
            )

    def reopen_job(self, job_id: str) -> None:
        """An ended job starts again (resume): PENDING, no end time, no reason."""
        with self._write() as db:
            db.execute("UPDATE jobs SET state = 'PENDING', ended = NULL, reason = NULL"
                       " WHERE id = ?", (job_id,))

    def count_events(self, job_id: str, kind: str) -> int:
        row = self._db.execute("SELECT COUNT(*) FROM events WHERE job_id = ? AND kind = ?",
                               (job_id, kind)).fetchone()
        return int(row[0])

    def get_job(self, ref: str) -> JobRecord:
        """A job by id, or by a unique prefix of its id, or the newest job of that name, or by
        its short id (`SHORT_REF`: the id's last four hex digits, alone or after its name)."""
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (ref,)).fetchone()
        if row is None:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE id LIKE ? ESCAPE '\\' ORDER BY created DESC",
                (_like(ref) + "%",),
            ).fetchall()
            names = [r for r in rows if r["name"] == ref]
            if not rows and (short := SHORT_REF.fullmatch(ref)) is not None:
                rows = [r for r in self._db.execute(
                    "SELECT * FROM jobs WHERE id LIKE ? ESCAPE '\\' ORDER BY created DESC",
                    ("%-" + short["short"],)).fetchall()
                    if short["name"] in (None, r["name"])]
            if names:
                row = names[0]
            elif len(rows) == 1:
                row = rows[0]
            elif len(rows) > 1:
                listed = ", ".join(r["id"] for r in rows[:5])
                raise JobNotFound(f"'{ref}' matches several jobs: {listed}")
        if row is None:
            raise JobNotFound(f"no job '{ref}' (see `nebula status` for the jobs there are)")
        return _job(row)

    def list_jobs(self) -> list[JobRecord]:
        rows = self._db.execute("SELECT * FROM jobs ORDER BY created DESC").fetchall()
        return [_job(r) for r in rows]

    # -- hosts ----------------------------------------------------------------------------
    def upsert_host(self, rec: HostRecord) -> None:
        rec.updated = time.time()
        with self._write() as db:
            db.execute(
                "INSERT INTO hosts (job_id, cluster, host, role, node_rank, slots, agent_dir,"
                " state, pid, pgid, exit_code, restarts, updated, detail)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
                " ON CONFLICT (job_id, cluster, host, role) DO UPDATE SET"
                " state = excluded.state, pid = excluded.pid, pgid = excluded.pgid,"
                " exit_code = excluded.exit_code, restarts = excluded.restarts,"
                " updated = excluded.updated, detail = excluded.detail,"
                " agent_dir = excluded.agent_dir",
                (rec.job_id, rec.cluster, rec.host, rec.role, rec.node_rank, rec.slots,
                 rec.agent_dir, rec.state, rec.pid, rec.pgid, rec.exit_code, rec.restarts,
                 rec.updated, json.dumps(rec.detail)),
            )

    def hosts(self, job_id: str) -> list[HostRecord]:
        rows = self._db.execute(
            "SELECT * FROM hosts WHERE job_id = ? ORDER BY cluster, node_rank, role DESC",
            (job_id,),
        ).fetchall()
        return [
            HostRecord(
                job_id=r["job_id"], cluster=r["cluster"], host=r["host"], role=r["role"],
                node_rank=r["node_rank"], slots=r["slots"], agent_dir=r["agent_dir"],
                state=r["state"], pid=r["pid"], pgid=r["pgid"], exit_code=r["exit_code"],
                restarts=r["restarts"], updated=r["updated"],
                detail=json.loads(r["detail"] or "{}"),
            )
            for r in rows
        ]

    # -- events ---------------------------------------------------------------------------
    def add_event(
        self, job_id: str, kind: str, message: str,
        cluster: str | None = None, host: str | None = None,
    ) -> None:
        with self._write() as db:
            db.execute(
                "INSERT INTO events (job_id, ts, cluster, host, kind, message)"
                " VALUES (?,?,?,?,?,?)",
                (job_id, time.time(), cluster, host, kind, message),
            )
            held = db.execute("SELECT COUNT(*) FROM events WHERE job_id = ?",
                              (job_id,)).fetchone()[0]
            if held > MAX_EVENTS + PRUNE_EVERY:
                self._prune_events(db, job_id)

    def _prune_events(self, db: sqlite3.Connection, job_id: str) -> None:
        """Keep a job's newest MAX_EVENTS events (and every one of the KEPT_EVENTS kinds): a
        month-long run that restarts processes now and then must not grow the store."""
        kept = ",".join("?" * len(KEPT_EVENTS))
        db.execute(
            f"DELETE FROM events WHERE job_id = ? AND kind NOT IN ({kept}) AND id <= ("
            "  SELECT id FROM events WHERE job_id = ? AND kind NOT IN"
            f"  ({kept}) ORDER BY id DESC LIMIT 1 OFFSET ?)",
            (job_id, *KEPT_EVENTS, job_id, *KEPT_EVENTS, MAX_EVENTS))

    def events(self, job_id: str, after_id: int = 0) -> list[Event]:
        rows = self._db.execute(
            "SELECT * FROM events WHERE job_id = ? AND id > ? ORDER BY id", (job_id, after_id)
        ).fetchall()
        return [Event(**dict(r)) for r in rows]


def _like(text: str) -> str:
    """`text` as a LIKE pattern that matches it literally (ESCAPE '\\')."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _job(row: sqlite3.Row) -> JobRecord:
    return JobRecord(
        id=row["id"], name=row["name"], spec_path=row["spec_path"],
        spec=json.loads(row["spec_json"]), state=row["state"], created=row["created"],
        started=row["started"], ended=row["ended"], reason=row["reason"],
    )
