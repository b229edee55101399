"""A command line for a remote shell that carries its environment on standard input.

Every user of a host sees command lines in `ps`; environment values (tokens, keys) must not be
there. `wrap` puts them on standard input, ahead of the caller's input, and a small shell
prologue exports them before it execs the command.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Reads NAME=VALUE lines from standard input up to a line ".", exports each (VALUE's
# backslash escapes undone by printf %b), then execs the command in "$@" with the rest of the
# input. `read` takes one byte at a time from a pipe, so nothing beyond the block is consumed.
PROLOGUE = (
    'while IFS= read -r __l && [ "$__l" != . ]; do __v=$(printf "%bx" "${__l#*=}"); '
    'export "${__l%%=*}=${__v%x}"; done; unset __l __v; exec "$@"'
)


def env_block(env: Mapping[str, str]) -> bytes:
    """The environment as `PROLOGUE` reads it: one escaped NAME=VALUE line each."""
    lines = []
    for key, value in env.items():
        escaped = str(value).replace("\\", "\\\\").replace("\n", "\\n")
        lines.append(f"{key}={escaped}\n")
    return ("".join(lines) + ".\n").encode()


def wrap(argv: Sequence[str] | str, env: Mapping[str, str] | None,
         cwd: str | None) -> tuple[str, bytes]:
    """(command line, standard input prefix) that runs `argv` in `cwd` with `env` added.

    A string command given with env or cwd runs as `/bin/sh -c COMMAND`, so that every part
    of it sees them; otherwise the login shell reads it as it is. ValueError for an invalid
    variable name."""
    wrapped = bool(env or cwd)
    body = (f"/bin/sh -c {shlex.quote(argv)}" if wrapped else argv) if isinstance(
        argv, str) else shlex.join(argv)
    prefix = b""
    if env:
        for key in env:
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"invalid environment variable name {key!r}")
        prefix = env_block(env)
        body = f"/bin/sh -c {shlex.quote(PROLOGUE)} nebula-env {body}"
    if cwd:
        body = f"cd {shlex.quote(cwd)} && {body}"
    return body, prefix
