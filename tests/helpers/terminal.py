"""A command run with a pseudo-terminal as its terminal, a prompt answered once: what a user at
a terminal does when `ssh` (or nebula) asks for a one-time code or a passphrase."""

from __future__ import annotations

import os
import pty
import select
import time
from collections.abc import Callable


def run_on_a_terminal(argv: list[str], env: dict[str, str], answer: Callable[[], str],
                      prompt: bytes, timeout: float = 120) -> tuple[int, str]:
    """Run argv (argv[0] a path) on a new pseudo-terminal; when `prompt` first shows, type
    `answer()` and Enter. Returns (exit status, everything it wrote on the terminal); killed
    after `timeout` seconds."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its controlling terminal is the pty
        try:
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)
    seen = b""
    answered = False
    status = None
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    data = os.read(fd, 4096)
                except OSError:
                    data = b""  # the child closed the terminal
                seen += data
                if not answered and prompt in seen:
                    os.write(fd, answer().encode() + b"\n")
                    answered = True
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = code
                break
        if status is None:
            os.kill(pid, 9)
            _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), seen.decode(errors="replace")
