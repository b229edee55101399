"""What bench/soak.py measures of a running job, and how it turns samples into growth rates.

- `processes(job_id)`: every live process of the job by kind (agent, logpump, relay, worker),
  found in /proc by the job id in its command line or its environment.
- `Sample`: one look at the job: rounds so far, RSS (MiB) and open descriptors summed per kind,
  bytes on disk under the job's directories (its hosts' and `$NEBULA_HOME/jobs/<id>`, and
  any given outside it) and `state.db`, `state.db`'s size, the time
  `nebula status JOB --json` took.
- `slope(xs, ys)`: the least-squares slope; `fit(xs, ys)`: the slope with its standard error;
  `lives(samples, kind)`: each process's (rounds, MiB, descriptors) over its life;
  `settled(points, warmup)`: those after its warm-up;
  `growth(samples, warmup)`: per kind, MiB and descriptors per 1,000 rounds, fitted per process
  after its warm-up (the largest slope).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("agent", "logpump", "relay", "worker")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def _environ_has(pid: int, mark: bytes) -> bool:
    try:
        return mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def kind_of(cmdline: str) -> str | None:
    if "nebula_cli.agent.logpump" in cmdline:
        return "logpump"
    if "nebula_cli.agent start" in cmdline or "nebula_cli.agent revive" in cmdline:
        return "agent"  # (not the short `agent status` calls of `nebula status`)
    if "nebula_cli.relay" in cmdline:
        return "relay"
    if "train.py" in cmdline and not cmdline.startswith(("/bin/sh", "sh ")):
        return "worker"
    return None


def processes(job_id: str) -> dict[str, list[int]]:
    """kind -> live pids of the job (zombies left out)."""
    mark = f"NEBULA_JOB_ID={job_id}".encode()
    out: dict[str, list[int]] = {k: [] for k in KINDS}
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        cmd = _cmdline(pid)
        if not cmd or (job_id not in cmd and not _environ_has(pid, mark)):
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except (OSError, IndexError):
            continue
        kind = kind_of(cmd)
        if kind:
            out[kind].append(pid)
    return out


def rss_mib(pid: int) -> float:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / (1 << 20)
    except (OSError, IndexError, ValueError):
        return 0.0


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def disk_bytes(paths: Iterable[Path]) -> int:
    total = 0
    for root in paths:
        for dirpath, _, names in os.walk(root):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def rounds_so_far(job_dir: Path) -> int:
    """The newest round any relay recorded (from the agents' metric summaries)."""
    best = 0
    for path in job_dir.glob("*/*/relay/metrics-summary.json"):
        try:
            files = json.loads(path.read_text()).get("files", {})
        except (OSError, ValueError):
            continue
        for state in files.values():
            r = state.get("latest", {}).get("round")
            if isinstance(r, int):
                best = max(best, r)
    return best


@dataclass
class Sample:
    t: float
    rounds: int
    rss: dict[str, float] = field(default_factory=dict)
    fds: dict[str, int] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    per_pid: dict[str, dict[int, tuple[float, int]]] = field(default_factory=dict)
    """kind -> pid -> (RSS MiB, descriptors): each process on its own (growth is fitted per
    process, so that a restart's fresh process is not read as shrinking, nor its warm-up as
    growth)."""
    disk: int = 0
    state_db: int = 0
    status_s: float | None = None
    """Seconds one `nebula status --json` took at this sample (None: not asked at it)."""


def take(job_id: str, home: Path, t: float, status_s: float | None,
         extra: Iterable[Path] = ()) -> Sample:
    """A sample now; `extra`: directories of the job outside `$NEBULA_HOME` (checkpoints at
    an absolute `checkpoint.dir`) counted in its disk bytes."""
    procs = processes(job_id)
    job_dir = home / "jobs" / job_id
    db = sum(p.stat().st_size for p in home.glob("state.db*"))
    per_pid = {k: {p: (round(rss_mib(p), 2), fds(p)) for p in v} for k, v in procs.items()}
    return Sample(t=t, rounds=rounds_so_far(job_dir),
                  rss={k: round(sum(x[0] for x in v.values()), 2) for k, v in per_pid.items()},
                  fds={k: sum(x[1] for x in v.values()) for k, v in per_pid.items()},
                  count={k: len(v) for k, v in procs.items()}, per_pid=per_pid,
                  disk=disk_bytes([job_dir, *extra]) + db, state_db=db, status_s=status_s)


@dataclass(frozen=True)
class Fit:
    """A least-squares line's slope and the slope's standard error (from the residuals, as if
    they were independent: samples of a process's memory are not quite, so it reads small)."""

    slope: float
    stderr: float


def fit(xs: list[float], ys: list[float]) -> Fit:
    n = len(xs)
    if n < 2:
        return Fit(0.0, 0.0)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if not var:
        return Fit(0.0, 0.0)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    if n < 3:
        return Fit(b, 0.0)
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    return Fit(b, (resid / (n - 2) / var) ** 0.5)


def slope(xs: list[float], ys: list[float]) -> float:
    return fit(xs, ys).slope


def settled(points: list[Any], warmup: float) -> list[Any]:
    """A process's samples after its own warm-up: its first `warmup` fraction left out, at least
    one."""
    return points[max(1, int(len(points) * warmup)):]


def lives(samples: list[Sample], kind: str) -> dict[int, list[tuple[int, float, int]]]:
    """pid -> (rounds, RSS MiB, descriptors) at each sample of its life, for one kind."""
    out: dict[int, list[tuple[int, float, int]]] = {}
    for s in samples:
        for pid, (rss, fd) in s.per_pid.get(kind, {}).items():
            out.setdefault(pid, []).append((s.rounds, rss, fd))
    return out


def growth(samples: list[Sample], warmup: float) -> dict[str, Any]:
    """Per kind: RSS MiB and descriptors per 1,000 rounds. Fitted per process over the samples
    of its life after its own warm-up (its first `warmup` fraction of them, at least one), then
    the largest slope among the kind's processes that lived through enough rounds (a restarted
    process starts small: across processes the sum would read restarts as growth or shrinking).
    Without per-process samples, the kind's sums over the run after `warmup` are fitted."""
    out: dict[str, Any] = {"rss_mb": {}, "fds": {}}
    for kind in KINDS:
        each = lives(samples, kind)
        rss_slopes, fd_slopes = [], []
        for points in each.values():
            rest = settled(points, warmup)
            if len(rest) < 3 or rest[-1][0] - rest[0][0] < 10:
                continue  # too short a life to say
            xs = [r / 1000 for r, _, _ in rest]
            rss_slopes.append(slope(xs, [m for _, m, _ in rest]))
            fd_slopes.append(slope(xs, [float(f) for _, _, f in rest]))
        if not each:
            rest = samples[int(len(samples) * warmup):]
            usual = max((s.count.get(kind, 0) for s in rest), default=0)
            pts = [s for s in rest if usual and s.count.get(kind, 0) == usual]
            xs = [s.rounds / 1000 for s in pts]
            rss_slopes = [slope(xs, [s.rss[kind] for s in pts])]
            fd_slopes = [slope(xs, [float(s.fds[kind]) for s in pts])]
        out["rss_mb"][kind] = round(max(rss_slopes, default=0.0), 3)
        out["fds"][kind] = round(max(fd_slopes, default=0.0), 3)
    return out
