"""What many tests share: the repository (`REPO`), the CLI runner (`CLI`), a job's processes and
their sweep, `/dev/shm` leftovers, where SSH hosts keep jobs, `wait_for`, `write_spec`, the
runtime hook's folder."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[2]


T = TypeVar("T")


def job_processes(job_id: str) -> list[int]:
    """Pids of processes whose environment carries NEBULA_JOB_ID=job_id."""
    mark = f"NEBULA_JOB_ID={job_id}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if mark in entry.joinpath("environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def shm_leftovers(job_dir: Path) -> list[Path]:
    """What of a job's worker worlds is still in /dev/shm: DeepSpeed's buffers, checkpoint
    staging directories."""
    from nebula_cli.agent import leftovers
    from nebula_cli.config import staging
    from nebula_cli.config.parts import AgentConfig

    found: list[Path] = []
    for path in job_dir.glob("*/*/worker/agent.json"):
        for proc in AgentConfig.load(path).processes[:1]:
            found += leftovers.shm_buffers(proc.env)
        record = path.parent / staging.RECORD  # removed only after what it names is gone
        if record.exists():
            named = staging.recorded(path.parent)
            found.append(named if named is not None and named.exists() else record)
    return found


def kill_job_processes(job_id: str) -> list[int]:
    pids = job_processes(job_id)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


@dataclass
class CLI:
    home: Path
    env: dict[str, str]

    def __call__(self, *args: str, timeout: float = 120, check: bool = False
                 ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "nebula_cli", *args], env=self.env, capture_output=True,
            text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"nebula {' '.join(args)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def job_ids(self) -> list[str]:
        jobs_dir = self.home / "jobs"
        return sorted(p.name for p in jobs_dir.iterdir()) if jobs_dir.exists() else []


REMOTE_JOBS = Path.home() / ".nebula" / "jobs"
"""Where jobs on the test bed's SSH hosts live (the hosts share this machine's filesystem)."""


def wait_for(pred: Callable[[], T], timeout: float = 30.0, every: float = 0.2) -> T:
    """pred()'s first truthy value, polled every `every` seconds for at most `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout:g} s")


def write_spec(directory: Path, body: str, name: str = "job.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body).lstrip())
    return path


HOOK_DIR = REPO / "nebula_cli" / "runtime" / "autohook"
