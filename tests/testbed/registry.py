"""The beds recorded on this machine (/tmp/nebula-testbed/<id>/state.json: creator pid, slot)
and the removal of every trace of a bed, also of beds whose creator process is gone
(`cleanup_stale()`; beds started with `python -m tests.testbed up` are kept)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from . import slurm as slurm_mod
from .system import (
    TestBedError,
    _alive,
    _cmdline,
    _sh,
    _start_time,
    kill_pids,
    list_namespaces,
    namespace_pids,
)

STATE_ROOT = Path("/tmp/nebula-testbed")
BED_ID = re.compile(r"^nb[0-9a-f]{4}$")


def destroy(bed_id: str, *, dirs: Sequence[Path] = ()) -> None:
    """Remove everything bed `bed_id` may have made: processes, namespaces, root veth, dirs."""
    if not BED_ID.match(bed_id):
        raise TestBedError(f"not a test bed id: {bed_id!r}")
    namespaces = [ns for ns in list_namespaces() if ns.startswith(f"{bed_id}-")]
    pids = [pid for ns in namespaces for pid in namespace_pids(ns)]
    kill_pids([pid for pid in pids if _cmdline(pid).startswith("slurmstepd")], grace=0.2)
    kill_pids(pids)
    state = None
    with contextlib.suppress(OSError, ValueError):
        state = json.loads((STATE_ROOT / bed_id / "state.json").read_text())
    slurm_mod.kill_root_daemons(bed_id, state)  # munged, in the root namespace
    for ns in namespaces:
        _sh(["ip", "netns", "del", ns], check=False)
    if Path(f"/sys/class/net/{bed_id}").exists():
        _sh(["ip", "link", "del", bed_id], check=False)
    for directory in (*dirs, STATE_ROOT / bed_id):
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(STATE_ROOT / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_states() -> dict[str, dict]:
    """State of every bed recorded under /tmp/nebula-testbed (id -> state dict)."""
    states = {}
    for path in sorted(STATE_ROOT.glob("nb*/state.json")):
        with contextlib.suppress(OSError, ValueError):
            states[path.parent.name] = json.loads(path.read_text())
    return states


def is_stale(state: dict) -> bool:
    """Whether a recorded bed's creator is gone (dead, a zombie, or its pid reused)."""
    if state.get("manual"):
        return False
    pid = state.get("pid")
    return not (isinstance(pid, int) and _alive(pid) and _start_time(pid) == state.get("pid_start"))


def cleanup_stale(*, include_manual: bool = False) -> list[str]:
    """Destroy beds whose creator process is gone, and `nb<4hex>` leftovers with no state.

    Beds made by `python -m tests.testbed up` are kept unless include_manual. Returns their ids.
    """
    removed = []
    with _state_lock():
        states = read_states()
        for bed_id, state in states.items():
            if is_stale(state) or (include_manual and state.get("manual")):
                destroy(bed_id, dirs=[Path(state["dir"])] if state.get("dir") else [])
                removed.append(bed_id)
        orphans = {ns.split("-", 1)[0] for ns in list_namespaces() if "-" in ns}
        orphans |= {p.name for p in Path("/sys/class/net").iterdir()}
        for bed_id in sorted(o for o in orphans if BED_ID.match(o) and o not in states):
            destroy(bed_id)
            removed.append(bed_id)
    return removed
