"""The tunnel keys' authorized_keys lines: what each may do, added, renewed and taken away.

A grant's line (`key_line`) is::

    restrict,command="env PYTHONPATH=<nebula> <python> -m nebula_cli.agent.bridge
    [--seen <file>] <target>",expiry-time="<YYYYMMDDHHMMSS>Z"[,from="<address>"]
    ssh-ed25519 AAAA... nebula-tunnel:<job>:<link>

- ``restrict``: no port forwarding of any kind (TCP or Unix socket, local or remote, ``-W``),
  no agent or X11 forwarding, no pty, no ~/.ssh/rc. Nothing is turned back on: OpenSSH's
  ``port-forwarding`` would also turn on Unix-socket forwarding, which no ``permitopen`` or
  ``permitlisten`` holds (the key's holder could make listening sockets as this account).
- ``command=``: whatever the holder asks for (a shell, a command, a subsystem such as sftp), sshd
  runs `nebula_cli.agent.bridge`, which joins the session to one of the grant's targets.
- ``expiry-time``: the key is refused after `TunnelConfig.grant_ttl` seconds (never after the
  grant's `expires`, the job's certificates' end) unless renewed: `Grants.renew`, called while
  the relay runs, pushes it on, so a relay killed before it could remove its lines leaves keys
  that stop working within that time (and `revoke`, run by the agent's `stop`, removes them).
  The cap is read again from the config's file before each renewal: the control plane's
  certificate renewal (`control.renewal`) moves it to the new certificates' end there.
- ``from=``: the key is refused from any address but the one its first session came from. A
  relay's grants (`Grants` with the config's file) name a file in the relay's 0700 agent folder
  (`tunnels/<peer>.from`) that the bridge writes, once, with the address sshd saw
  (SSH_CONNECTION's first word: the dialling host's, or the NAT's in front of it, which is all
  an address check can hold there); `pin` then writes the line again with it. Nothing knows
  that address before the first session (the dialler's own view of its address is not what sshd
  sees behind a NAT), so until then the key is held by the rest alone. A dialler whose address
  changes during the job (a NAT with a pool of addresses) loses its tunnel: its ssh log says
  "Permission denied" and the relay's log names the pinned address.

The command names this host's Python and nebula's directory as the process writing the line
sees them (the relay's), so the bridge runs from the same installation. Standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import ipaddress
import os
import shlex
import sys
import time
from pathlib import Path

from nebula_cli.agent import authkeys
from nebula_cli.config.tunnel_config import TunnelConfig, TunnelGrant

BRIDGE_MODULE = "nebula_cli.agent.bridge"
NEBULA_ROOT = str(Path(__file__).resolve().parents[2])
"""The directory nebula_cli is imported from here (what the forced command puts on
PYTHONPATH)."""
SEEN_FLAG = "--seen"
"""The bridge's option naming the file it writes its session's source address into."""
SEEN_DIR = "tunnels"
"""The folder, in the relay's agent folder, of the files the bridge writes (`seen_file`)."""
SEEN_MAX = 128
"""Most bytes of a seen file read (an address and a line break)."""


def seen_file(agent_dir: Path, grant: TunnelGrant) -> Path:
    """Where the bridge of `grant`'s sessions writes the address its first session came from."""
    return agent_dir / SEEN_DIR / f"{grant.peer}.from"


def bridge_command(targets: list[str], python: str = sys.executable,
                   root: str = NEBULA_ROOT, seen: Path | None = None) -> str:
    """The forced command (a line for the account's login shell) of a key reaching `targets`
    (`seen`: the file its bridge writes its first session's address into)."""
    flag = [SEEN_FLAG, str(seen)] if seen is not None else []
    words = ["env", f"PYTHONPATH={root}", python, "-m", BRIDGE_MODULE, *flag, *targets]
    command = " ".join(shlex.quote(w) for w in words)
    if any(c in command for c in '"\\\n\r'):  # authorized_keys quotes the command in "..."
        raise ValueError(f"cannot name {python} or {root} in an authorized_keys command "
                         "(a double quote, backslash or line break in the path)")
    return command


def expiry(now: float, ttl: int, cap: int) -> int:
    """When a line written at `now` stops working: `ttl` on, never after `cap`."""
    return min(int(now) + ttl, cap)


def key_line(grant: TunnelGrant, until: int, command: str | None = None,
             source: str | None = None) -> str:
    """The authorized_keys line of `grant`, valid until the Unix time `until` (from `source`
    only, when given: an address)."""
    stamp = dt.datetime.fromtimestamp(until, dt.UTC)
    options = ["restrict", f'command="{command or bridge_command(grant.targets)}"',
               f'expiry-time="{stamp:%Y%m%d%H%M%S}Z"']
    if source is not None:
        options.append(f'from="{ipaddress.ip_address(source)}"')
    return f"{','.join(options)} {grant.public_key} {grant.tag}"


def read_seen(path: Path) -> str | None:
    """The address a bridge wrote into `path` (None: none yet, or not an address)."""
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            return str(ipaddress.ip_address(f.read(SEEN_MAX).decode("ascii").strip()))
    return None


class Grants:
    """A config's grants on this host: written with a short expiry, renewed, taken away."""

    def __init__(self, cfg: TunnelConfig, path: str | Path | None = None) -> None:
        self.cfg = cfg
        self.path = path
        """The config's file, whose grants' `expires` (the cap) `renew` reads again, and beside
        which the bridge says where each key's first session came from (`pin`)."""
        self.agent_dir = Path(path).resolve().parent if path is not None else None
        self.sources: dict[str, str] = {}
        """Each pinned grant's address (by tag): its line's ``from=``."""
        self.renewed = 0.0

    def _new_caps(self) -> None:
        """Take the grants' `expires` from the config's file as it is now (a certificate
        renewal moved them on); the rest of a grant stays as it was loaded."""
        if self.path is None:
            return
        caps = {g.tag: g.expires for g in TunnelConfig.load(self.path).grant}
        grants = [dataclasses.replace(g, expires=caps.get(g.tag, g.expires))
                  for g in self.cfg.grant]
        self.cfg = dataclasses.replace(self.cfg, grant=grants)

    def _seen(self, grant: TunnelGrant) -> Path | None:
        return seen_file(self.agent_dir, grant) if self.agent_dir is not None else None

    def _write(self, ttl: int | None) -> None:
        now = time.time()
        by_file: dict[str, list[str]] = {}
        for g in self.cfg.grant:
            until = g.expires if ttl is None else expiry(now, ttl, g.expires)
            command = bridge_command(g.targets, seen=self._seen(g))
            by_file.setdefault(g.authorized_keys, []).append(
                key_line(g, until, command, self.sources.get(g.tag)))
        for path, lines in by_file.items():
            authkeys.add_lines(path, lines)
        self.renewed = time.monotonic()

    def add(self, *, renewed: bool = True) -> None:
        """Add every grant's line; valid `grant_ttl` seconds when it will be `renew`ed, else
        until the grant's `expires` (a grant no process stays to renew: bench-network's). A
        seen file an earlier run of the relay left is removed first: each run learns anew."""
        for g in self.cfg.grant:
            if (seen := self._seen(g)) is not None:
                seen.parent.mkdir(mode=0o700, exist_ok=True)
                seen.unlink(missing_ok=True)
        self._write(self.cfg.grant_ttl if renewed else None)

    def pin(self) -> list[tuple[TunnelGrant, str]]:
        """Write again, with ``from=``, the lines of the grants whose first session has come
        (the bridge wrote its address); those grants and their addresses."""
        pinned = []
        for g in self.cfg.grant:
            if g.tag not in self.sources and (seen := self._seen(g)) is not None \
                    and (source := read_seen(seen)) is not None:
                self.sources[g.tag] = source
                pinned.append((g, source))
        if pinned:
            self._write(self.cfg.grant_ttl)
        return pinned

    def renew(self) -> bool:
        """Push the lines' expiry on when a third of `grant_ttl` has passed; whether it did."""
        if not self.cfg.grant or time.monotonic() - self.renewed < self.cfg.grant_ttl / 3:
            return False
        try:  # a file that cannot be read keeps the caps it had, and is said by the caller
            self._new_caps()
        finally:
            self._write(self.cfg.grant_ttl)
        return True

    def revoke(self) -> list[str]:
        """Remove the grants' lines; the files changed."""
        changed = []
        for path in dict.fromkeys(g.authorized_keys for g in self.cfg.grant):
            tags = [g.tag for g in self.cfg.grant if g.authorized_keys == path]
            if authkeys.remove_tagged(path, tags):
                changed.append(path)
        return changed
