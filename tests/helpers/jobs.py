"""What many tests share: the repository (`REPO`), the CLI runner (`CLI`), a job's processes and
their sweep, `/dev/shm` leftovers, where SSH hosts keep jobs, `wait_for`, `wait_in_job` (with
the job's story when it fails), `write_spec`, the runtime hook's folder."""

from __future__ import annotations

import contextlib
import json
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


def wait_in_job(cli: CLI, job_id: str, pred: Callable[[], T], timeout: float,
                what: str, every: float = 0.5, status_every: float = 5.0) -> T:
    """pred()'s first truthy value while the job runs. Fails at once when the job has ended
    first, and at `timeout`, either way with the job's state, reason and each process's last
    log lines in the message (what a failure on CI needs to be understood)."""
    deadline = time.monotonic() + timeout
    next_status = time.monotonic() + status_every
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if time.monotonic() >= next_status:
            next_status = time.monotonic() + status_every
            st = json.loads(cli("status", job_id, "--json", check=True).stdout)
            if st["state"] not in ("RUNNING", "STARTING"):
                value = pred()  # (it may have come true just before the end)
                if value:
                    return value
                raise AssertionError(f"{what}: the job ended first\n{job_story(cli, job_id)}")
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:g} s\n{job_story(cli, job_id)}")


def job_story(cli: CLI, job_id: str, lines: int = 15) -> str:
    """The job's state, reason, hosts and the last `lines` of each process's log."""
    st = cli("status", job_id, "--json")
    logs = cli("logs", job_id, "--tail", str(lines))
    return (f"status: {st.stdout.strip()[-4000:]}\n{st.stderr.strip()[-1000:]}\n"
            f"logs:\n{logs.stdout[-12000:]}\n{logs.stderr[-2000:]}")


def write_spec(directory: Path, body: str, name: str = "job.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body).lstrip())
    return path


HOOK_DIR = REPO / "nebula_cli" / "runtime" / "autohook"
