"""A relay with its SSH tunnels: relays that cannot dial each other meet through SSH sessions.

    python -m nebula_cli.agent.tunnel run --config tunnels.json -- CMD...   # the relay inside
    python -m nebula_cli.agent.tunnel grant AGENT_DIR...                    # keys in (bench)
    python -m nebula_cli.agent.tunnel revoke AGENT_DIR...                   # a job's keys out

Where `reach` says that a pair of clusters' relays meets through a tunnel (the dialled one has
`relay_reach: ssh`, or both are `outbound`), the plan gives both relays a `tunnels.json`
(`config.tunnel_config`) and their agents run the relay under `run`:

- on the dialled cluster's host, `run` adds one authorized_keys line per tunnel before the
  relay starts, renews its expiry while the relay runs (never past the cap its tunnels.json
  says when it renews: the certificates' end, moved on when they are renewed), and removes it
  when the relay ends
  (`revoke`, run by the agent's `stop`, removes what a killed relay left). The line
  (`nebula_cli.agent.grants`) grants no forwarding at all: ``restrict``, a forced command
  (`nebula_cli.agent.bridge`) that joins the SSH session's stdin and stdout to the relay's
  port and nothing else, and an ``expiry-time`` minutes ahead (never after the job's
  certificates' end): no shell, no command, no pty, no agent or X11 forwarding, no TCP or
  Unix-socket forwarding either way, and a key of a killed relay refused soon after; once the
  key's first session has come, its line is written again with ``from=`` that session's
  address (`Grants.pin`), so the key is refused from anywhere else;
- on the dialler's host, `run` starts the relay and listens on the tunnel's local end, a Unix
  socket file in the relay's agent folder (``tunnels/<peer>.sock``, 0600 in a 0700 folder, a
  long path bound through /proc/self/fd: `agent.unix_socket`), reached only by processes of
  the job's user (the kernel's uid of each connection is checked, another's closed before ssh
  starts), so no other user of the host (often a login node) can take the tunnel's sessions
  or drive logins with the job's key. Every connection accepted there rides its own system
  ``ssh HOST TARGET`` with
  the connection as ssh's stdin and stdout (BatchMode, ServerAliveInterval, no ssh_config, no
  agent, no forwarding, the job's key only, the SSH host's key pinned: StrictHostKeyChecking
  against the key nebula verified in known_hosts when it reached that host, under a
  HostKeyAlias of the job), ended with it; ssh's messages (a key refused, a connection lost) go
  into the relay's log. The relay dials the tunnel's local end instead of the peer's address,
  and dials again when a connection ends.

Everything runs host to host: the launching machine makes the keys and writes the files, then
takes no part (a laptop that sleeps, or a `launch` that is killed, changes nothing).

What this trusts: the tunnel carries the relays' mutual TLS 1.3 unchanged, so the tunnel adds
no trust: a relay still accepts only a certificate of this job's CA for the expected cluster.
What the tunnel needs is an account on the dialled host that accepts a key for the job's
duration (the key is made per tunnel and per attempt; whoever holds it can reach that relay
port, as anyone on the network could reach an `inbound` relay), a login shell there that
prints nothing for a command (as scp needs), and the SSH host key nebula already trusted for
that host. The private keys live only on the dialling relay's host (0600) and in the
launching machine's memory while it launches.

When CMD ends (or on SIGTERM/SIGINT, passed on to it), the tunnels are ended, the grants'
lines removed, and `run` ends as CMD did (its exit code, or the same signal). Standard library
only: it runs on hosts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from nebula_cli.agent import unix_socket
from nebula_cli.agent.grants import Grants
from nebula_cli.config.tunnel_config import TUNNELS_FILE, TunnelConfig, TunnelDial
from nebula_cli.errors import NebulaError

MAX_SESSIONS = 8
"""Connections one tunnel carries at once (each an ssh; a relay needs one: its link to the
tunnel's peer; on a Unix socket end all of them are the job's user's)."""
POLL = 0.2
STOP_WAIT = 5.0
LAST_WORDS = 300
LOG_BOUND = 1 << 20
"""ssh's messages file is emptied once this many bytes of it were echoed into the relay's log
(which rotates): a tunnel that reconnects for a month does not fill the disk."""


def say(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} nebula-tunnel: {message}", flush=True)


def ssh_argv(dial: TunnelDial, keepalive: int, count: int) -> list[str]:
    """The ssh command of one connection through the tunnel (nothing from the host's
    ssh_config or agent; no pty, no forwarding, no escape character)."""
    options = {
        "BatchMode": "yes", "IdentitiesOnly": "yes", "IdentityFile": dial.key,
        "IdentityAgent": "none", "StrictHostKeyChecking": "yes",
        "UserKnownHostsFile": dial.known_hosts, "GlobalKnownHostsFile": "/dev/null",
        "HostKeyAlias": dial.alias, "CheckHostIP": "no", "UpdateHostKeys": "no",
        "ServerAliveInterval": str(keepalive), "ServerAliveCountMax": str(count),
        "ConnectTimeout": str(keepalive * count), "ClearAllForwardings": "yes",
        "ControlMaster": "no", "ControlPath": "none", "PermitLocalCommand": "no",
        "ForwardAgent": "no", "ForwardX11": "no", "LogLevel": "ERROR",
    }
    argv = ["ssh", "-T", "-e", "none", "-F", "/dev/null"]
    for key, value in options.items():
        argv += ["-o", f"{key}={value}"]
    return [*argv, "-p", str(dial.port), "-l", dial.user, "--", dial.host, dial.target]


class Tunnel:
    """One tunnel's local end: each connection accepted rides its own ssh, ended with it."""

    def __init__(self, dial: TunnelDial, keepalive: int, count: int) -> None:
        self.dial, self.argv = dial, ssh_argv(dial, keepalive, count)
        self.server: socket.socket | None = None
        self.inode: int | None = None
        """The socket file's inode while it listens on one (removed at `close`)."""
        self.sessions: list[subprocess.Popen[bytes]] = []
        self.where = f"{dial.user}@{dial.host}:{dial.port}"
        try:  # what earlier runs of the relay left in the log is not repeated
            self.seen = os.path.getsize(dial.log)
        except OSError:
            self.seen = 0
        self.said = ""

    def open(self) -> socket.socket:
        """Listen on the local end, a Unix socket file (OSError: another tunnel serves it, or
        its folder is not this user's)."""
        self.server = unix_socket.listen(self.dial.listen, "tunnel")
        self.inode = os.stat(self.dial.listen).st_ino
        self.server.setblocking(False)
        Path(self.dial.log).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        say(f"tunnel to {self.dial.peer} up: {self.dial.listen} -> {self.dial.target} through "
            f"{self.where} (an ssh per connection)")
        return self.server

    def accept(self) -> None:
        """Start an ssh for each connection waiting (beyond MAX_SESSIONS: closed)."""
        assert self.server is not None
        while True:
            try:
                conn, _ = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            with conn:
                self.reap()
                if (uid := unix_socket.peer_uid(conn)) != os.getuid():
                    say(f"tunnel to {self.dial.peer}: a connection of uid {uid} closed (only "
                        f"uid {os.getuid()}'s relay may use it)")
                    continue
                if len(self.sessions) >= MAX_SESSIONS:
                    say(f"tunnel to {self.dial.peer}: {MAX_SESSIONS} connections open, "
                        "one more closed")
                    continue
                conn.setblocking(True)
                with open(self.dial.log, "ab") as log:
                    self.sessions.append(subprocess.Popen(self.argv, stdin=conn, stdout=conn,
                                                          stderr=log))

    def echo(self) -> None:
        """ssh's new messages (a refused key, a lost connection) into the relay's log,
        a message repeated only when another came between."""
        try:
            size = os.path.getsize(self.dial.log)
            if size <= self.seen:
                self.seen = min(self.seen, size)
                return
            with open(self.dial.log, "rb") as fh:
                fh.seek(self.seen)
                data = fh.read(min(size - self.seen, 1 << 16))
        except OSError:
            return
        cut = data.rfind(b"\n") + 1
        if not cut and len(data) == 1 << 16:  # a line longer than what is read at once
            cut = len(data)
        self.seen += cut
        for line in data[:cut].decode(errors="replace").splitlines():
            if (line := line.strip()) and line != self.said:
                self.said = line
                say(f"tunnel to {self.dial.peer}: ssh: {line[:LAST_WORDS]}")
        self._bound()

    def _bound(self) -> None:
        """Empty ssh's messages file once LOG_BOUND of it was echoed and nothing more came
        (the sessions' ssh append to it: they go on writing at its new end)."""
        try:
            if self.seen >= LOG_BOUND and os.path.getsize(self.dial.log) == self.seen:
                os.truncate(self.dial.log, 0)
                self.seen = 0
        except OSError:
            return

    def reap(self) -> None:
        """Forget the sessions that ended; one that failed is said."""
        for proc in [p for p in self.sessions if p.poll() is not None]:
            self.sessions.remove(proc)
            if proc.returncode:
                say(f"tunnel to {self.dial.peer} through {self.where}: a connection's ssh "
                    f"ended (exit {proc.returncode})")

    def poll(self) -> None:
        self.echo()
        self.reap()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
            if self.inode is not None:
                unix_socket.unlink_own(self.dial.listen, self.inode)
                self.inode = None
        for proc in self.sessions:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.sessions:
            try:
                proc.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_WAIT)
        self.sessions = []


def grant_dir(agent_dir: Path) -> None:
    """Add a directory's tunnels.json's grants until their `expires` (bench-network's probe
    servers: no process stays to renew them)."""
    Grants(TunnelConfig.load(agent_dir / TUNNELS_FILE)).add(renewed=False)


def revoke_dir(agent_dir: Path) -> list[str]:
    """What `revoke` removes for a relay's agent directory (nothing when it has no tunnels)."""
    path = agent_dir / TUNNELS_FILE
    return Grants(TunnelConfig.load(path)).revoke() if path.is_file() else []


def _serve(tunnels: list[Tunnel], grants: Grants, child: subprocess.Popen[bytes],
           got: list[int]) -> None:
    """Until the command ends: connections into ssh sessions, the grants renewed."""
    with selectors.DefaultSelector() as sel:
        for t in tunnels:
            sel.register(t.open(), selectors.EVENT_READ, t)
        while child.poll() is None:
            for key, _ in sel.select(POLL):
                if not got:
                    key.data.accept()
            for t in tunnels:
                t.poll()
            try:
                for g, source in grants.pin():
                    say(f"key of the tunnel from {g.peer} pinned to from=\"{source}\" (its "
                        "first session's address as this host sees it; a session from another "
                        "address is refused)")
                grants.renew()
            except (OSError, NebulaError) as exc:
                say(f"cannot renew the tunnel keys of {grants.cfg.cluster}'s relay: {exc}")


def run(cfg: TunnelConfig, command: list[str], path: Path | None = None) -> int:
    """Run `command` with `cfg`'s tunnels and grants (`path`: the config's file, whose grants'
    caps a certificate renewal moves on)."""
    if cfg.dial and shutil.which("ssh") is None:
        peers = ", ".join(d.peer for d in cfg.dial)
        say(f"ssh not found on this host (install openssh-client): relay {cfg.cluster} cannot "
            f"reach {peers} through an SSH tunnel")
        return 127
    got: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, _frame: object) -> None:
        got.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    tunnels = [Tunnel(d, cfg.keepalive, cfg.keepalive_count) for d in cfg.dial]
    grants = Grants(cfg, path)
    try:
        try:
            grants.add()
            for g in cfg.grant:
                say(f"key of the tunnel from {g.peer} added to {g.authorized_keys} ({g.tag})")
        except (OSError, ValueError) as exc:
            say(f"cannot add the tunnel keys of {cfg.cluster}'s relay: {exc}")
            return 1
        if got:
            return 128 + got[0]
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        try:
            _serve(tunnels, grants, child, got)
        except OSError as exc:  # a local end that cannot listen
            say(f"relay {cfg.cluster}: cannot listen on a tunnel's local end: {exc}")
            child.send_signal(signal.SIGTERM)
            child.wait()
            return 1
    finally:
        for t in tunnels:
            t.echo()  # what ssh said since the last look
            t.close()
        with contextlib.suppress(OSError):
            if (changed := grants.revoke()):
                say(f"tunnel keys removed from {', '.join(changed)}")
    code = child.returncode
    if code < 0:  # end as the command did
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nebula-tunnel", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("run", help="run CMD with the config's tunnels and grants")
    start.add_argument("--config", type=Path, required=True)
    start.add_argument("cmd", nargs=argparse.REMAINDER)
    add = sub.add_parser("grant", help="add the tunnel keys of each directory's tunnels.json")
    add.add_argument("dirs", type=Path, nargs="+")
    out = sub.add_parser("revoke", help="remove the tunnel keys of each agent directory")
    out.add_argument("dirs", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "grant":
        try:
            for d in args.dirs:
                grant_dir(d)
        except (NebulaError, OSError, ValueError) as exc:
            say(f"cannot add tunnel keys: {exc}")
            return 1
        return 0
    if args.command == "revoke":
        for d in args.dirs:
            for path in revoke_dir(d):
                print(f"removed tunnel keys from {path}")
        return 0
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        parser.error("run: no command after --")
    try:
        cfg = TunnelConfig.load(args.config)
    except NebulaError as exc:
        say(str(exc))
        return 2
    return run(cfg, command, args.config)


if __name__ == "__main__":
    sys.exit(main())
