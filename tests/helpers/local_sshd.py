"""A real sshd on 127.0.0.1 for transport tests (root only): its own host key, config and log,
the user's key authorized, with or without the SFTP subsystem; an SSHTransport to it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from helpers.sshd_bed import PRIVSEP_DIR, SSHD, descendants, free_port, keygen

from nebula_cli.transport.hostkeys import host_entry_name
from nebula_cli.transport.ssh.transport import SSHTransport


class LocalSshd:
    """One sshd (``-D``: it stays in the foreground, its own child) on a free loopback port."""

    def __init__(self, directory: Path, *, sftp: bool, extra: str = "",
                 authorized_keys: bool = True, pam: str | None = None) -> None:
        """`extra`: sshd_config lines placed first (sshd keeps a keyword's first value, so
        they win; no `Match`). `authorized_keys` False: `AuthorizedKeysFile none` (a site
        that accepts only certificates, its CA in `extra`). `pam`: the PAM configuration of
        this sshd alone (bound over /etc/pam.d/sshd in a mount namespace of its own; `extra`
        then says `UsePAM yes`)."""
        self.dir = directory
        self.user_key = keygen(directory / "user_key")
        host_key = keygen(directory / "host_key")
        self.port = free_port()
        authorized = directory / "authorized_keys"
        authorized.write_text(self.user_key.with_suffix(".pub").read_text())
        keys_file = authorized if authorized_keys else "none"
        config = directory / "sshd_config"
        config.write_text(
            extra + f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {host_key}\n"
            f"PidFile {directory / 'sshd.pid'}\nAuthorizedKeysFile {keys_file}\n"
            "StrictModes no\nUsePAM no\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
            + ("Subsystem sftp internal-sftp\n" if sftp else "") + "LogLevel INFO\n")
        pub = " ".join(host_key.with_suffix(".pub").read_text().split()[:2])
        self.host_key_line = pub
        """The host key as a known_hosts line has it after the name: ``type base64``."""
        self.known_hosts = directory / "known_hosts"
        self.known_hosts.write_text(f"{host_entry_name('127.0.0.1', self.port)} {pub}\n")
        self.log = directory / "sshd.log"
        self.made_privsep = not PRIVSEP_DIR.exists()
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        argv = [SSHD, "-D", "-e", "-f", str(config)]
        if pam is not None:
            pam_file = directory / "pam_sshd"
            pam_file.write_text(pam)
            argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                    'mount --bind "$0" /etc/pam.d/sshd && exec "$@"', str(pam_file), *argv]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while "Server listening" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sshd did not start:\n{self.log.read_text()}")
            time.sleep(0.05)

    def transport(self) -> SSHTransport:
        return SSHTransport("target", host="127.0.0.1", user="root", port=self.port,
                            key=str(self.user_key), known_hosts=str(self.known_hosts),
                            ssh_config=str(self.dir / "no_ssh_config"), connect_timeout=5.0)

    def stop(self) -> None:
        """End the sshd and its sessions (its descendants)."""
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        if self.made_privsep:
            with contextlib.suppress(OSError):
                PRIVSEP_DIR.rmdir()


@contextlib.contextmanager
def local_sshd(directory: Path, *, sftp: bool, extra: str = "",
               authorized_keys: bool = True, pam: str | None = None) -> Iterator[LocalSshd]:
    server = LocalSshd(directory, sftp=sftp, extra=extra, authorized_keys=authorized_keys,
                       pam=pam)
    try:
        yield server
    finally:
        server.stop()
