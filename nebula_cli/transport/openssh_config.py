"""What the user's own OpenSSH makes of a host: `ssh -G` run and read, its %-tokens expanded.

`ssh -G` prints the configuration OpenSSH would use for a destination, after every `Include`,
`Match` (host, user, exec, ...), wildcard `Host` block and `CanonicalizeHostname` of the
user's ssh_config (and the system's, unless a file is named with `-F`): the only parser that
agrees with `ssh` itself. It connects nowhere. Some values (IdentityFile, CertificateFile,
UserKnownHostsFile, ProxyCommand) still hold the %-tokens OpenSSH expands when it connects;
`expand_tokens` does that with the resolved host, port and user.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from nebula_cli.errors import TransportError

SSH_BINARY = "ssh"
G_TIMEOUT = 20.0
"""Seconds `ssh -G` may take (a `Match exec` of the user's config runs a command)."""
DEFAULT_IDENTITY_FILES = frozenset(
    f"~/.ssh/{name}" for name in ("id_rsa", "id_ecdsa", "id_ecdsa_sk", "id_ed25519",
                                  "id_ed25519_sk", "id_xmss", "id_dsa"))
"""What `ssh -G` lists when the config names no IdentityFile."""


def ssh_binary() -> str | None:
    """The OpenSSH client on PATH, or None (then paramiko's parser reads ssh_config)."""
    return shutil.which(SSH_BINARY)


@dataclass(frozen=True)
class Resolved:
    """What `ssh -G` printed for one destination."""

    options: dict[str, list[str]]
    """{option: [values]}: lower-case options, one value per printed line, in order."""
    applied: tuple[str, ...]
    """The blocks that applied, as ``file:line (pattern)`` (from `ssh -v -G`)."""


_APPLIED = re.compile(r"debug1: (?P<file>.+) line (?P<line>\d+): Applying options for (?P<pat>.+)")


def ssh_g(host: str, *, config_path: str | None, user: str | None = None,
          port: int | None = None) -> Resolved:
    """`ssh -v -G [-F config_path] [-l user] [-p port] host`, read. `config_path` None: the
    user's and the system's files as `ssh` reads them; a path that does not exist: no file at
    all (`-F none`). TransportError naming the host and the file when OpenSSH refuses the
    configuration."""
    binary = ssh_binary()
    if binary is None:
        raise TransportError("no `ssh` client on PATH (install OpenSSH's client)", host=host)
    argv = [binary, "-v", "-G"]
    if config_path is not None:
        argv += ["-F", config_path if os.path.exists(config_path) else "none"]
    if user:
        argv += ["-l", user]
    if port:
        argv += ["-p", str(port)]
    argv += ["--", host]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=G_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise TransportError(f"`{' '.join(argv)}` took longer than {G_TIMEOUT:g} s (a slow "
                             "`Match exec` in your ssh config?)", host=host) from exc
    if proc.returncode != 0:
        said = " ".join(line for line in proc.stderr.splitlines()
                        if "Pseudo-terminal" not in line and not line.startswith(("debug",
                                                                                  "OpenSSH_")))
        said = said.strip()
        where = config_path or "~/.ssh/config (or /etc/ssh/ssh_config)"
        raise TransportError(f"OpenSSH cannot read the configuration for {host!r} in {where}: "
                             f"{said or f'`ssh -G` exited {proc.returncode}'}; fix it until "
                             f"`ssh -G {host}` works", host=host)
    options: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key:
            options.setdefault(key.lower(), []).append(value.strip())
    applied = tuple(f"{m['file']}:{m['line']} ({m['pat'].strip()})"
                    for m in map(_APPLIED.fullmatch, proc.stderr.splitlines()) if m)
    return Resolved(options, applied)


def expand_tokens(text: str, *, host: str, hostname: str, port: int, user: str,
                  extra: Mapping[str, str] | None = None) -> str:
    """`text` with OpenSSH's %-tokens replaced, as ssh_config(5) "TOKENS" defines them:
    %% %d %h %i %L %l %n %p %r %u (and those in `extra`, e.g. ``{"k": alias}``); `~` at the
    start expanded. An unknown token is left as it is."""
    local = socket.gethostname()
    values = {"%": "%", "d": os.path.expanduser("~"), "h": hostname, "i": str(os.getuid()),
              "L": local.split(".")[0], "l": local, "n": host, "p": str(port), "r": user,
              "u": getpass.getuser(), **(extra or {})}
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "%" and i + 1 < len(text) and text[i + 1] in values:
            out.append(values[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return os.path.expanduser("".join(out))
