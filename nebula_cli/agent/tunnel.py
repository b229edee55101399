"""A relay with its SSH tunnels: relays that cannot dial each other meet through `ssh -N -L`.

    python -m nebula_cli.agent.tunnel run --config tunnels.json -- CMD...   # the relay inside
    python -m nebula_cli.agent.tunnel grant AGENT_DIR...                    # keys in (bench)
    python -m nebula_cli.agent.tunnel revoke AGENT_DIR...                   # a job's keys out

Where `reach` says that a pair of clusters' relays meets through a tunnel (the dialled one has
`relay_reach: ssh`, or both are `outbound`), the plan gives both relays a `tunnels.json`
(`config.tunnel_config`) and their agents run the relay under `run`:

- on the dialled cluster's host, `run` adds one authorized_keys line per tunnel before the
  relay starts, and removes it when the relay ends (and `revoke`, run by the agent's `stop`,
  removes what a killed relay left). The line lets the job's key for that tunnel do one thing:
  ``restrict,port-forwarding,permitopen="<relay port as this host sees it>",
  permitlisten="127.0.0.1:1",command="/bin/false",expiry-time="<certificates' end>"``: no
  shell, no command, no pty, no agent or X11 forwarding, local forwarding to the relay's port
  only, remote forwarding only to a port nothing uses (authorized_keys cannot refuse it
  outright), and nothing after the job's certificates expire even if no one removed it;
- on the dialler's host, `run` starts the relay and keeps one system ``ssh -N -L
  127.0.0.1:<port>:<target>`` per tunnel (BatchMode, ExitOnForwardFailure, ServerAliveInterval,
  no ssh_config, no agent, the job's key only, the SSH host's key pinned: StrictHostKeyChecking
  against the key nebula verified in known_hosts when it reached that host, under a
  HostKeyAlias of the job), and starts it again when it exits (backoff 1 s, doubling to 30 s,
  back to 1 s after a minute up); ssh's messages (a forwarding refused, a connection lost) go
  into the relay's log. The relay dials
  the tunnel's local end instead of the peer's address.

Everything runs host to host: the launching machine makes the keys and writes the files, then
takes no part (a laptop that sleeps, or a `launch` that is killed, changes nothing).

What this trusts: the tunnel carries the relays' mutual TLS 1.3 unchanged, so the tunnel adds
no trust: a relay still accepts only a certificate of this job's CA for the expected cluster.
What the tunnel needs is an account on the dialled host that accepts a key for the job's
duration (the key is made per tunnel and per attempt; whoever holds it can reach that relay
port, as anyone on the network could reach an `inbound` relay), and the SSH host key nebula
already trusted for that host. The private keys live only on the dialling relay's host (0600)
and in the launching machine's memory while it launches.

When CMD ends (or on SIGTERM/SIGINT, passed on to it), the tunnels are ended, the grants'
lines removed, and `run` ends as CMD did (its exit code, or the same signal). Standard library
only: it runs on hosts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from nebula_cli.agent import authkeys
from nebula_cli.config.tunnel_config import TunnelConfig, TunnelDial
from nebula_cli.errors import NebulaError

BACKOFF_FIRST = 1.0
BACKOFF_MAX = 30.0
STABLE_AFTER = 60.0
"""Seconds up after which a tunnel that ends is started again at once (backoff reset)."""
POLL = 0.2
STOP_WAIT = 5.0
LAST_WORDS = 300


def say(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} nebula-tunnel: {message}", flush=True)


def ssh_argv(dial: TunnelDial, keepalive: int, count: int) -> list[str]:
    """The ssh command of one tunnel (nothing from the host's ssh_config or agent)."""
    options = {
        "BatchMode": "yes", "IdentitiesOnly": "yes", "IdentityFile": dial.key,
        "IdentityAgent": "none", "StrictHostKeyChecking": "yes",
        "UserKnownHostsFile": dial.known_hosts, "GlobalKnownHostsFile": "/dev/null",
        "HostKeyAlias": dial.alias, "CheckHostIP": "no", "UpdateHostKeys": "no",
        "ExitOnForwardFailure": "yes", "ServerAliveInterval": str(keepalive),
        "ServerAliveCountMax": str(count), "ConnectTimeout": str(keepalive * count),
        "ControlMaster": "no", "ControlPath": "none", "PermitLocalCommand": "no",
        "ForwardAgent": "no", "ForwardX11": "no", "LogLevel": "INFO",
    }
    argv = ["ssh", "-N", "-T", "-F", "/dev/null"]
    for key, value in options.items():
        argv += ["-o", f"{key}={value}"]
    return [*argv, "-p", str(dial.port), "-l", dial.user, "-L", f"{dial.listen}:{dial.target}",
            "--", dial.host]


class Tunnel:
    """One `ssh -N -L`, started again whenever it ends (until `close`)."""

    def __init__(self, dial: TunnelDial, keepalive: int, count: int) -> None:
        self.dial, self.argv = dial, ssh_argv(dial, keepalive, count)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = self.next_start = 0.0
        self.backoff = BACKOFF_FIRST
        self.where = f"{dial.user}@{dial.host}:{dial.port}"
        try:  # what earlier runs of the relay left in the log is not repeated
            self.seen = os.path.getsize(dial.log)
        except OSError:
            self.seen = 0
        self.said = ""

    def start(self) -> None:
        Path(self.dial.log).parent.mkdir(parents=True, exist_ok=True)
        with open(self.dial.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=log)
        self.started = time.monotonic()
        say(f"tunnel to {self.dial.peer} up: {self.dial.listen} -> {self.dial.target} through "
            f"{self.where} (ssh pid {self.proc.pid})")

    def echo(self) -> None:
        """ssh's new messages (a refused forwarding, a lost connection) into the relay's log,
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

    def poll(self, stopping: bool) -> None:
        now = time.monotonic()
        self.echo()
        if self.proc is not None and (code := self.proc.poll()) is not None:
            if now - self.started >= STABLE_AFTER:
                self.backoff = BACKOFF_FIRST
            delay, self.backoff = self.backoff, min(self.backoff * 2, BACKOFF_MAX)
            self.proc, self.next_start = None, now + delay
            if not stopping:
                say(f"tunnel to {self.dial.peer} through {self.where} ended (ssh exit {code}); "
                    f"again in {delay:g} s")
        if self.proc is None and not stopping and now >= self.next_start:
            self.start()

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_WAIT)


def grant(cfg: TunnelConfig) -> None:
    for g in cfg.grant:
        authkeys.add_lines(g.authorized_keys, [g.line])
        say(f"key of the tunnel from {g.peer} added to {g.authorized_keys} ({g.tag})")


def revoke(cfg: TunnelConfig) -> list[str]:
    """Remove the config's grants' lines; the files changed."""
    changed = []
    for path in dict.fromkeys(g.authorized_keys for g in cfg.grant):
        tags = [g.tag for g in cfg.grant if g.authorized_keys == path]
        if authkeys.remove_tagged(path, tags):
            changed.append(path)
    return changed


def grant_dir(agent_dir: Path) -> None:
    """What `grant` adds for a directory's tunnels.json (bench-network's probe servers)."""
    grant(TunnelConfig.load(agent_dir / "tunnels.json"))


def revoke_dir(agent_dir: Path) -> list[str]:
    """What `revoke` removes for a relay's agent directory (nothing when it has no tunnels)."""
    path = agent_dir / "tunnels.json"
    return revoke(TunnelConfig.load(path)) if path.is_file() else []


def run(cfg: TunnelConfig, command: list[str]) -> int:
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
    try:
        try:
            grant(cfg)
        except OSError as exc:
            say(f"cannot add the tunnel keys of {cfg.cluster}'s relay: {exc}")
            return 1
        if got:
            return 128 + got[0]
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        while child.poll() is None:
            for t in tunnels:
                t.poll(stopping=bool(got))
            time.sleep(POLL)
    finally:
        for t in tunnels:
            t.echo()  # what ssh said since the last look
            t.close()
        with contextlib.suppress(OSError):
            if (changed := revoke(cfg)):
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
        except (NebulaError, OSError) as exc:
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
    return run(cfg, command)


if __name__ == "__main__":
    sys.exit(main())
