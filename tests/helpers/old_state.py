"""A `$NEBULA_HOME` whose state.db an earlier version of nebula wrote (its SQL dump, under
tests/control/data/), for tests that read it with this version."""

from __future__ import annotations

import sqlite3
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "control" / "data"


def old_home(home: Path, commit: str = "1b4814b") -> Path:
    """`home` with the state.db of `commit` (`state_<commit>.sql`); `home` returned."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    db = sqlite3.connect(home / "state.db")
    try:
        db.executescript((DATA / f"state_{commit}.sql").read_text())
    finally:
        db.close()
    return home
