"""A relay's listening TCP socket on its planned port, waiting out a port in use for a while.

The port was found free when the job was planned (`nebula_cli.transport.freeport`) and told to
the relay's peers and workers; the relay binds it seconds later, after its imports. If another
process holds it meanwhile (seen once on a loaded machine: for ten seconds), four restarts of
the relay in a row failed and so did the job. So the relay tries again for up to
:data:`BIND_WAIT_S`, says what holds the port (the process, from /proc, where it can see it),
and only then gives up, naming the holder and the fix.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from nebula_cli.errors import NebulaError

log = logging.getLogger("nebula.relay")

BIND_WAIT_S = 60.0
"""How long a relay waits for its planned port to come free."""
BIND_RETRY_S = 0.5


def listen_tcp(host: str, port: int, *, backlog: int = 64, wait: float = BIND_WAIT_S,
               stopping: threading.Event | None = None,
               clock: Callable[[], float] = time.monotonic,
               who: Callable[[int], str] | None = None) -> socket.socket:
    """A TCP socket listening on (host, port). While the port is in use, tried again every
    :data:`BIND_RETRY_S` for up to ``wait`` seconds (said once in the log, with its holder);
    then NebulaError naming the port, its holder and the fix; at once when ``stopping`` is set
    meanwhile (the relay was told to stop). Any other error at once. The holder is looked up
    (a scan of /proc: ``who``, :func:`holders` by default) when it is said, not at every try."""
    who = who or holders
    deadline = clock() + wait
    said = False
    while True:
        try:
            return socket.create_server((host, port), backlog=backlog)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise NebulaError(f"relay cannot listen on {host}:{port}: "
                                  f"{exc.strerror or exc}") from exc
            late = clock() >= deadline
            if late or (stopping is not None and stopping.is_set()):
                held = who(port)
                why = (f"in use for {wait:g} s" if late
                       else "in use, and the relay was told to stop while it waited")
                raise NebulaError(
                    f"relay cannot listen on {host}:{port}: {why}"
                    f"{f' (by {held})' if held else ''}; end that process, or relaunch the "
                    "job (a new launch plans other ports)") from exc
            if not said:
                said = True
                held = who(port)
                log.warning("relay: %s:%d is in use%s; trying again for up to %g s", host, port,
                            f" (by {held})" if held else "", wait)
        if stopping is not None:
            stopping.wait(BIND_RETRY_S)
        else:
            time.sleep(BIND_RETRY_S)


def holders(port: int, proc: Path = Path("/proc")) -> str:
    """The processes with a TCP socket on local port ``port`` ("pid 12 (python -u x.py), ...";
    "" where /proc does not say: another user's processes, or not Linux)."""
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    inodes.discard("0")  # (a connection in TIME_WAIT belongs to no process)
    if not inodes:
        return ""
    found = []
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            links = {os.readlink(fd) for fd in (pid_dir / "fd").iterdir()}
        except OSError:
            continue
        if any(f"socket:[{i}]" in links for i in inodes):
            found.append(f"pid {pid_dir.name} ({_command(pid_dir)})")
    return ", ".join(sorted(found))


def _command(pid_dir: Path) -> str:
    try:
        raw = (pid_dir / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120] or "?"
