"""`transport: openssh` on a host that asks a one-time code after the key (sshd with
`AuthenticationMethods publickey,keyboard-interactive` and a real TOTP checked by PAM's
pam_oath): `launch` asks for the code once, on its terminal (a pseudo-terminal the test
answers with `oathtool`); `status`, `logs` and `stop`, run afterwards without a terminal, go
through the same master connection and are never asked again; without a terminal and without
a master, the host is one error naming it and the fix (transport/openssh.py).

REALWORLD row (SSH): `AuthenticationMethods publickey,keyboard-interactive` (a one-time code
after the key)."""

from __future__ import annotations

import os
import pty
import re
import secrets
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import CLI, REMOTE_JOBS, wait_for, write_spec
from helpers.local_sshd import SSHD, LocalSshd, local_sshd

from nebula_cli.transport.openssh import OpenSSHTransport

PAM_OATH = Path("/lib/x86_64-linux-gnu/security/pam_oath.so")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SSHD) or shutil.which("ssh") is None
    or shutil.which("oathtool") is None or not PAM_OATH.exists()
    or shutil.which("unshare") is None,
    reason="needs root, openssh-server and client, libpam-oath and oathtool")]


class OtpHost:
    """An sshd that wants the key, then a TOTP code from its own PAM stack."""

    def __init__(self, server: LocalSshd, secret: str, config: Path) -> None:
        self.server, self.secret, self.config = server, secret, config

    def code(self) -> str:
        return subprocess.run(["oathtool", "--totp", self.secret], check=True, text=True,
                              capture_output=True).stdout.strip()

    def logins(self) -> int:
        """Sessions that answered the code (one per master connection)."""
        return self.server.log.read_text(errors="replace").count(
            "Accepted keyboard-interactive/pam")


@pytest.fixture
def otp_host(tmp_path: Path) -> Iterator[OtpHost]:
    secret = secrets.token_hex(20)
    users = tmp_path / "users.oath"
    users.write_text(f"HOTP/T30/6 root - {secret}\n")
    users.chmod(0o600)
    pam = (f"auth required {PAM_OATH} usersfile={users} window=4 digits=6\n"
           "account required pam_permit.so\nsession required pam_permit.so\n"
           "password required pam_deny.so\n")
    (tmp_path / "d").mkdir()
    with local_sshd(tmp_path / "d", sftp=False, pam=pam, extra=(
            "UsePAM yes\nKbdInteractiveAuthentication yes\nPermitRootLogin yes\n"
            "AuthenticationMethods publickey,keyboard-interactive\n")) as server:
        config = tmp_path / "ssh_config"
        config.write_text(f"Host otp-login\n  HostName 127.0.0.1\n  Port {server.port}\n"
                          f"  User root\n  IdentityFile {server.user_key}\n"
                          "  IdentitiesOnly yes\n")
        host = OtpHost(server, secret, config)
        try:
            yield host
        finally:
            OpenSSHTransport("otp-login", ssh_config=str(config),
                             known_hosts=str(server.known_hosts)).exit_master()


def run_on_a_terminal(argv: list[str], env: dict[str, str], answer: Callable[[], str],
                      prompt: bytes,
                      timeout: float = 120) -> tuple[int, str]:
    """Run argv with a pseudo-terminal as its terminal; answer `prompt` once with `answer`
    (computed when it is asked). Returns (exit status, everything it wrote)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its terminal is the pty
        os.execve(argv[0], argv, env)
    seen = b""
    answered = False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    data = os.read(fd, 4096)
                except OSError:
                    break  # the child closed the terminal
                if not data:
                    break
                seen += data
                if not answered and prompt in seen:
                    os.write(fd, answer().encode() + b"\n")
                    answered = True
            finished, status = os.waitpid(pid, os.WNOHANG)
            if finished:
                break
        else:
            os.kill(pid, 9)
        _, status = os.waitpid(pid, 0) if not finished else (pid, status)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), seen.decode(errors="replace")


def test_the_code_is_asked_once_at_launch_and_never_by_status_logs_stop(
        cli: CLI, otp_host: OtpHost, tmp_path: Path) -> None:
    cli.env["NEBULA_SSH_CONFIG"] = str(otp_host.config)
    cli.env["NEBULA_KNOWN_HOSTS"] = str(otp_host.server.known_hosts)
    spec = write_spec(tmp_path, f"""\
        name: otp
        workdir: {tmp_path}
        run: for i in $(seq 1 60); do echo "tick $i on $NEBULA_HOST"; sleep 1; done
        clusters:
          - name: hpc
            transport: openssh
            python: {sys.executable}
            hosts: [otp-login]
          - name: here
            transport: local
            hosts: [l1]
        """)
    # No terminal and no master: one error naming the host and how to open the master.
    plain = cli("validate", str(spec), "--hosts", timeout=120)
    said = " ".join((plain.stdout + plain.stderr).split())
    assert plain.returncode == 1 and "hpc/otp-login" in said, said
    assert "no terminal to ask on" in said and "-M -N -f" in said
    assert otp_host.logins() == 0

    code, shown = run_on_a_terminal(
        [sys.executable, "-m", "nebula_cli", "launch", str(spec), "--detach"],
        cli.env, otp_host.code, prompt=b"One-time password")
    ids = re.findall(r"otp-\d{8}-\d{6}-[0-9a-f]+", shown)
    assert ids, shown
    job_id = ids[-1]
    try:
        assert code == 0, shown
        assert otp_host.logins() == 1
        status = cli("status", job_id, check=True)
        assert "RUNNING" in status.stdout, status.stdout
        wait_for(lambda: "tick 2 on otp-login" in cli("logs", job_id).stdout, timeout=60)
        stopped = cli("stop", job_id, check=True)
        assert f"{job_id} stopped" in stopped.stdout
        assert otp_host.logins() == 1  # status, logs and stop asked nothing
    finally:
        shutil.rmtree(REMOTE_JOBS / job_id, ignore_errors=True)
