"""A `nebula launch` interrupted with a real SIGINT at a chosen moment, and what its output
mentions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.jobs import CLI, REPO, wait_for


def mentions(job_id: str) -> list[int]:
    """Processes whose command line or environment names the job (agents, relays, setup)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        if int(entry.name) == os.getpid():
            continue
        try:
            blob = entry.joinpath("cmdline").read_bytes() + entry.joinpath("environ").read_bytes()
        except OSError:
            continue
        if job_id.encode() in blob:
            found.append(int(entry.name))
    return found


def launch_and_interrupt(cli: CLI, spec: Path, ready: str) -> tuple[str, int, float]:
    """Start `nebula launch`, wait for `ready` in the job's launch.log, send SIGINT; return
    (job id, exit status, seconds from the signal to the exit)."""
    proc = subprocess.Popen([sys.executable, "-m", "nebula_cli", "launch", str(spec)],
                            env=cli.env, cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job_id = wait_for(lambda: (cli.job_ids() or [None])[0], timeout=60)
        log = cli.home / "jobs" / job_id / "launch.log"
        wait_for(lambda: log.exists() and log.read_text().count(ready) >= 1, timeout=90)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        return job_id, code, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
