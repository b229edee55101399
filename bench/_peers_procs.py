"""The processes of one peer job of bench/peers.py (`Procs`): started in bed hosts with a clean
environment and their own process group, waited for with a deadline, ended on every path; and
`read_maddr`, the first line a hivemind peer prints (its multiaddr) read from its piped stdout,
whose rest then goes on to its log (`drain`)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import _bed


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """A clean environment for a peer's process (nothing of nebula's venv)."""
    keep = {k: os.environ[k] for k in ("HOME", "LANG", "TMPDIR", "HIVEMIND_LOGLEVEL")
            if k in os.environ}
    return {**keep, "PATH": "/usr/local/bin:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "eth0", **extra}


class Procs:
    """The processes of one peer job: started in bed hosts, waited for, ended on every path."""

    def __init__(self, bed: Any, tmp: Path, name: str) -> None:
        self.bed, self.tmp, self.name = bed, tmp, name
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, label: str, host: str, argv: list[str], env: dict[str, str],
              **kwargs: Any) -> subprocess.Popen:
        log = self.tmp / f"{self.name}-{label}.log"
        piped = kwargs.pop("stdout", None) is subprocess.PIPE
        with open(log, "w") as f:  # the child keeps its own descriptor
            proc = self.bed.popen(host, argv, env=clean_env(env), cwd=str(_bed.REPO),
                                  stdout=subprocess.PIPE if piped else f,
                                  stderr=f if piped else subprocess.STDOUT,
                                  start_new_session=True, **kwargs)
        self.procs.append((label, proc, log))
        return proc

    def log(self, label: str) -> Path:
        return self.tmp / f"{self.name}-{label}.log"

    def tail(self, label: str, lines: int = 25) -> str:
        for lab, _, log in self.procs:
            if lab == label and log.exists():
                return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def wait(self, labels: list[str], timeout: float) -> None:
        """Wait until every process named exits; RuntimeError naming the first that failed (or
        that was still running at the deadline), with its log's tail."""
        deadline = time.monotonic() + timeout
        for label, proc, _ in self.procs:
            if label not in labels:
                continue
            try:
                rc = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{self.name} {label}: still running after {timeout:.0f} s:\n"
                                   f"{self.tail(label)}") from None
            if rc != 0:
                raise RuntimeError(f"{self.name} {label} exited {rc}:\n{self.tail(label)}")

    def stop(self) -> None:
        """End every process of the job (its whole process group), the helpers included."""
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for _, proc, _ in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def drain(proc: subprocess.Popen, log: Path) -> None:
    """Copy what a piped process still prints into its log, so that it never blocks on a full
    pipe (a daemon thread; it ends with the process's stdout)."""
    def copy() -> None:
        assert proc.stdout is not None
        with open(log, "a") as f:
            for line in proc.stdout:
                f.write(line)
                f.flush()

    threading.Thread(target=copy, daemon=True).start()


def read_maddr(proc: subprocess.Popen, log: Path, timeout: float) -> str | None:
    """The `MADDR <multiaddr>` line a peer prints once its DHT runs; the rest of its stdout
    then goes to its log (`drain`)."""
    import selectors

    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(max(0.1, deadline - time.monotonic())):
                return None
            line = proc.stdout.readline()
            if not line:
                return None
            if line.startswith("MADDR "):
                drain(proc, log)
                return line.split()[1]
    return None

