"""A real sshd on 127.0.0.1 (root only): `Sshd`, `start_sshd`, a target and a jump host (`Bed`, the
`bed` fixture, registered in conftest), the marks of a module that needs sshd (`NEEDS_SSHD`),
and process-tree helpers."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nebula_cli.transport import freeport
from nebula_cli.transport.hostkeys import host_entry_name
from nebula_cli.transport.ssh.transport import (
    SSHTransport,
)

SSHD = "/usr/sbin/sshd"
NEEDS_SSHD = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a test sshd"),
    pytest.mark.skipif(not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None,
                       reason="needs openssh-server (/usr/sbin/sshd) and ssh-keygen"),
]
"""The marks of a module whose tests start sshd (its `pytestmark`)."""


def free_port() -> int:
    """A loopback port for a test's server, drawn as the product draws its services' ports
    (below the ephemeral range, where other tests' connections and bind(0)s take theirs)."""
    return freeport.free_port("127.0.0.1")


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass
class Sshd:
    name: str
    port: int
    host_key: Path
    log: Path
    proc: subprocess.Popen[bytes]

    @property
    def pub_line(self) -> str:
        """`type base64` of this server's host key."""
        return " ".join(self.host_key.with_suffix(".pub").read_text().split()[:2])

    def known_line(self, port: int | None = None) -> str:
        return f"{host_entry_name('127.0.0.1', port or self.port)} {self.pub_line}\n"

    def accepted(self) -> int:
        return self.log.read_text(errors="replace").count("Accepted publickey")

    def stop(self) -> None:
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def start_sshd(directory: Path, name: str, authorized: Path, sftp: bool = True) -> Sshd:
    host_key = keygen(directory / f"{name}_host_ed25519")
    port = free_port()
    config = directory / f"{name}_sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\n"
        f"PidFile {directory / f'{name}.pid'}\nAuthorizedKeysFile {authorized}\n"
        "StrictModes no\nUsePAM no\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
        + ("Subsystem sftp internal-sftp\n" if sftp else "")  # hardened sites drop it
        + "AllowTcpForwarding yes\nLogLevel INFO\n")  # MaxSessions, MaxStartups: stock
    log = directory / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = Sshd(name, port, host_key, log, proc)
    deadline = time.monotonic() + 10
    while "Server listening" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"sshd {name} did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return server


@dataclass
class Bed:
    dir: Path
    user_key: Path
    wrong_key: Path
    target: Sshd
    jump: Sshd
    known_hosts: Path
    no_config: Path
    remote_dir: str  # "~/.nebula-test-<random>"
    nosftp: Sshd  # an sshd without the SFTP subsystem

    def transport(self, **kw: object) -> SSHTransport:
        args: dict[str, object] = dict(
            host="127.0.0.1", user="root", port=self.target.port, key=str(self.user_key),
            known_hosts=str(self.known_hosts), ssh_config=str(self.no_config),
            connect_timeout=5.0)
        args.update(kw)
        return SSHTransport("target", **args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    directory = tmp_path_factory.mktemp("sshbed")
    made_privsep = not PRIVSEP_DIR.exists()
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    user_key = keygen(directory / "user_key")
    wrong_key = keygen(directory / "wrong_key")
    authorized = directory / "authorized_keys"
    authorized.write_text(user_key.with_suffix(".pub").read_text())
    name = f".nebula-test-{uuid.uuid4().hex[:10]}"
    servers: list[Sshd] = []
    try:
        servers.append(start_sshd(directory, "target", authorized))
        servers.append(start_sshd(directory, "jump", authorized))
        servers.append(start_sshd(directory, "nosftp", authorized, sftp=False))
        known = directory / "known_hosts"
        known.write_text("".join(s.known_line() for s in servers))
        yield Bed(directory, user_key, wrong_key, servers[0], servers[1], known,
                  directory / "no_ssh_config", f"~/{name}", servers[2])
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(Path(pwd.getpwuid(0).pw_dir) / name, ignore_errors=True)
        if made_privsep:
            with contextlib.suppress(OSError):
                PRIVSEP_DIR.rmdir()


PRIVSEP_DIR = Path("/run/sshd")


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f",
                    str(path)], check=True, capture_output=True, timeout=30)
    return path
