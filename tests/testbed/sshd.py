"""The SSH side of the test bed's hosts: host keys, known_hosts, ssh_config (with ProxyJump
aliases through the bastion), each host's sshd with stock MaxSessions and MaxStartups; a mixin
of TestBed.

ProxyJump is meaningful through the source address: `ssh -F ssh_config e1` arrives from the root
namespace's mgmt address, `ssh -F ssh_config e1-jump` (ProxyJump bastion) from the bastion's
address (see SSH_CONNECTION on the host)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from .system import TestBedError, _alive, _cmdline, _sh, kill_pids, namespace_pids

if TYPE_CHECKING:
    from .bed import Host
    from .slurm import SlurmCluster

SSHD = "/usr/sbin/sshd"


class SshHosts:
    """TestBed's sshds and SSH files (needs its hosts, bastion, dir and key paths)."""

    id: str
    dir: Path
    hosts: dict[str, Host]
    bastion: Host | None
    slurm: SlurmCluster | None
    _cut: set[str]
    _stopped: set[str]

    def _write_ssh_files(self) -> None:
        lines = []
        for host in self._all_hosts():
            key = self.dir / host.name / "ssh_host_ed25519_key"
            key.parent.mkdir(mode=0o700, exist_ok=True)
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.id}-{host.name}",
                 "-f", str(key)])
            kind, blob = key.with_suffix(".pub").read_text().split()[:2]
            lines.append(f"{host.address} {kind} {blob}\n")
        self.known_hosts.write_text("".join(lines))

        def block(alias: str, host: Host, jump: bool) -> str:
            return "\n".join([
                f"Host {alias}", f"  HostName {host.address}", "  User root",
                f"  Port {host.ssh_port}", f"  IdentityFile {self.user_key}",
                "  IdentitiesOnly yes", f"  UserKnownHostsFile {self.known_hosts}",
                "  GlobalKnownHostsFile /dev/null", "  StrictHostKeyChecking yes",
                "  BatchMode yes", "  ConnectTimeout 10", "  LogLevel ERROR",
                *(["  ProxyJump bastion"] if jump else []), "", ""])

        text = f"# nebula test bed {self.id}: ssh -F {self.ssh_config} <alias>\n\n"
        for host in self._all_hosts():
            text += block(host.name, host, jump=False)
        if self.bastion:
            for host in self.hosts.values():
                text += block(f"{host.name}-jump", host, jump=True)
        self.ssh_config.write_text(text)

    def _write_sshd_config(self, host: Host) -> None:
        hdir = self.dir / host.name
        (hdir / "sshd_config").write_text("\n".join([
            f"# nebula test bed {self.id}: sshd of {host.name}",
            f"ListenAddress {host.address}:{host.ssh_port}",
            f"HostKey {hdir / 'ssh_host_ed25519_key'}",
            f"PidFile {hdir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.user_key}.pub {self.authorized_keys(host.name)}",
            "StrictModes no", "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
            "X11Forwarding no", "AllowTcpForwarding yes", "PrintMotd no", "PrintLastLog no",
            "UseDNS no", "LoginGraceTime 30",  # MaxSessions, MaxStartups: stock (10, 10:30:100)
            f"SetEnv NEBULA_TESTBED_HOST={host.name} NEBULA_TESTBED_CLUSTER={host.cluster}"
            + (f" SLURM_CONF={self.slurm.conf}"
               if self.slurm and host.name == self.slurm.login.name else ""),
            "Subsystem sftp internal-sftp", "",
        ]))

    def authorized_keys(self, host: str) -> Path:
        """A second AuthorizedKeysFile of the host's sshd, empty unless a test writes it (all
        hosts share root's home: a spec's `authorized_keys` names this file instead)."""
        return self.dir / host / "authorized_keys"

    def _sshd_pid(self, host: Host) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            pid = int((self.dir / host.name / "sshd.pid").read_text().strip())
            if _alive(pid):
                return pid
        return None

    def start_sshd(self, host: str) -> None:
        """Start the host's sshd and wait until it accepts connections."""
        h = self._host(host)
        if not h.sshd:
            raise TestBedError(f"{host} is a Slurm compute node: it has no sshd")
        if self._sshd_pid(h) is None:
            hdir = self.dir / h.name
            _sh(["ip", "netns", "exec", h.ns, SSHD, "-f", str(hdir / "sshd_config"),
                 "-E", str(hdir / "sshd.log")])
        self._stopped.discard(h.name)
        if h.name not in self._cut:
            self.wait_listening(h.name, h.ssh_port)

    def stop_sshd(self, host: str) -> None:
        """Stop the host's listening sshd (sessions already open keep running)."""
        h = self._host(host)
        pid = self._sshd_pid(h)
        if pid is not None:
            kill_pids([pid])
        self._stopped.add(h.name)

    def end_stale_sessions(self, host: str) -> list[int]:
        """Kill the sshd session processes of `host` (not its listener): after a cut, the
        sessions of the dead connections linger until sshd notices, which is not a leak of the
        code under test."""
        listener = self._sshd_pid(self._host(host))
        stale = [pid for pid in namespace_pids(self._host(host).ns)
                 if pid != listener and _cmdline(pid).startswith("sshd: ")]
        kill_pids(stale)
        return stale
