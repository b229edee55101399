"""A process's output into its rotated log: the reader of the pipe its stdout and stderr go to.

A worker rank or a relay writes to a pipe, not to its log file: a file held open by another
process cannot be rotated without losing what it writes meanwhile (copy-and-truncate drops the
bytes written between the copy and the truncate). The pump reads the pipe and appends to the
log with `config.rotation.append` as it comes (rotation by rename, nothing lost; a rotated
file ends at a line's end unless a line is longer than the slack).

The agent starts one pump per process, in a session of its own and marked with the agent's
directory (so `stop` sweeps it with the rest), and it outlives the agent: a host agent that is
killed leaves its processes' output going to their logs. It ignores SIGTERM, SIGINT and SIGHUP
(the group's end is the end of its input) and exits once every writer of the pipe has closed
it, after writing the last bytes.

    python -m nebula_cli.agent.logpump --rotation MAX_BYTES:KEEP LOG   # the pipe on stdin
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nebula_cli.config.rotation import Rotation, append
from nebula_cli.config.staging import AGENT_DIR_ENV

READ = 64 << 10


def pump(fd: int, log: str, rotation: Rotation | None) -> None:
    """Copy `fd` to `log` as it comes, until end of input."""
    while True:
        try:
            chunk = os.read(fd, READ)
        except InterruptedError:
            continue
        if not chunk:
            return
        with contextlib.suppress(OSError):  # a full disk: the output is lost, training goes on
            append(log, chunk, rotation)


def start_pump(read_end: int, log: Path, agent_dir: Path,
               rotation: Rotation) -> subprocess.Popen[bytes]:
    """The writer of one process's log, reading `read_end`: its own session, so that neither
    ending the group nor the agent's death cuts the log short; marked with the agent's
    directory, so that `stop` sweeps what is left of it."""
    env = {**os.environ, AGENT_DIR_ENV: str(agent_dir)}
    return subprocess.Popen(
        [sys.executable, "-m", "nebula_cli.agent.logpump", str(log),
         "--rotation", rotation.to_env()],
        stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        cwd=agent_dir, start_new_session=True)


def drain(pumps: list[subprocess.Popen[bytes]], within: float) -> None:
    """Wait (at most `within` seconds) for pumps to write their last bytes and end."""
    deadline = time.monotonic() + within
    for pump in pumps:
        with contextlib.suppress(subprocess.TimeoutExpired):
            pump.wait(timeout=max(0.0, deadline - time.monotonic()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nebula-logpump", description=__doc__.split("\n")[0])
    parser.add_argument("log")
    parser.add_argument("--rotation", default="", help="MAX_BYTES:KEEP (none: never rotate)")
    args = parser.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    pump(sys.stdin.fileno(), args.log, Rotation.from_env(args.rotation))
    return 0


if __name__ == "__main__":
    sys.exit(main())
