"""bench/scale.py's sampler: every process of a running job that the outer step runs in (each
cluster's relay and each rank of its training), named by its role, its peak memory read from
/proc every few tenths of a second until the job ends (bench/_scale_figures.py's two peaks),
and each relay's idle size: its peak at the last sample before any rank could have begun the
first round (no rank 0 past step H - 2 yet)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import _scale_figures as figures
from _soak_sample import processes

from nebula_cli.planner.outer_memory import ProcessRole


@dataclass
class ProcessPeak:
    """One process of the job and the largest of its peaks over the samples."""

    cluster: str
    role: ProcessRole
    rank: int | None
    """The rank within its cluster (None: the relay)."""
    pid: int
    peak: int = 0
    """VmHWM + the memfd/shm mappings not resident in it (a shared page counted once)."""
    peak_issue: int = 0
    """VmHWM + every memfd/shm mapping (issue 42's definition: touched shared pages twice)."""
    shared: int = 0
    """The largest memfd/shm mapping total seen."""
    idle: int | None = None
    """A relay's `peak` before round 1 (None: a rank, or never sampled idle)."""
    idle_issue: int | None = None
    """The same of `peak_issue`."""

    @property
    def key(self) -> tuple[str, str, int | None]:
        return self.cluster, self.role.value, self.rank


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                if "=" in item)


def _identify(pid: int, kind: str) -> ProcessPeak | None:
    env = _environ(pid)
    cluster = env.get("NEBULA_CLUSTER")
    if not cluster:
        return None
    if kind == "relay":
        return ProcessPeak(cluster, ProcessRole.RELAY, None, pid)
    if "RANK" not in env:
        return None
    rank = int(env["RANK"])
    return ProcessPeak(cluster, ProcessRole.RANK0 if rank == 0 else ProcessRole.RANK, rank, pid)


def _newest_step(job_dir: Path) -> int:
    """The newest step any cluster's rank 0 logged (its metrics files, read whole: short)."""
    best = 0
    for path in job_dir.glob("*/*/worker/metrics/rank0.jsonl"):
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines()[-3:]:
                with contextlib.suppress(ValueError, AttributeError):
                    best = max(best, int(json.loads(line).get("step") or 0))
    return best


class Sampler:
    """Samples a job's relays and ranks on a thread from `start()` to `stop()`; `peaks()`: each
    process sampled, by (cluster, role, rank). A process seen again under a new pid (a restart)
    is kept as its larger peak."""

    def __init__(self, job_id: str, job_dir: Path, inner_steps: int, every: float = 0.2) -> None:
        self.job_id, self.job_dir, self.h, self.every = job_id, job_dir, inner_steps, every
        self._by_pid: dict[int, ProcessPeak] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._scan_at = 0.0
        self.samples = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _scan(self) -> None:
        for kind, pids in processes(self.job_id).items():
            if kind not in ("relay", "worker"):
                continue
            for pid in pids:
                if pid not in self._by_pid and (who := _identify(pid, kind)) is not None:
                    self._by_pid[pid] = who

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= self._scan_at:  # new processes: a full /proc walk, once a second
                self._scan()
                self._scan_at = now + 1.0
            idle = _newest_step(self.job_dir) < self.h - 1
            for pid, who in list(self._by_pid.items()):
                try:
                    hwm, shared = figures.vm_hwm(pid), figures.shared_mappings(pid)
                    resident = figures.rss_shmem(pid)
                except (OSError, ValueError):
                    continue  # gone
                once = hwm + max(0, shared - resident)
                who.peak = max(who.peak, once)
                who.peak_issue = max(who.peak_issue, hwm + shared)
                who.shared = max(who.shared, shared)
                if idle and who.role is ProcessRole.RELAY:
                    who.idle, who.idle_issue = once, hwm + shared
            self.samples += 1
            self._stop.wait(self.every)

    def peaks(self) -> dict[tuple[str, str, int | None], ProcessPeak]:
        out: dict[tuple[str, str, int | None], ProcessPeak] = {}
        for who in self._by_pid.values():
            if who.key not in out or who.peak > out[who.key].peak:
                out[who.key] = who
        return out
