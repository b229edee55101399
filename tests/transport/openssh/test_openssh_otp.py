"""`transport: openssh` on a host that asks a one-time code after the key (sshd with
`AuthenticationMethods publickey,keyboard-interactive` and a real TOTP checked by PAM's
pam_oath): `launch` asks for the code once, on its terminal (a pseudo-terminal the test
answers with `oathtool`); `status`, `logs` and `stop`, run afterwards without a terminal, go
through the same master connection and are never asked again; without a terminal and without
a master, the host is one error naming it and the fix (transport/openssh/transport.py).

REALWORLD row (SSH): `AuthenticationMethods publickey,keyboard-interactive` (a one-time code
after the key)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.jobs import CLI, REMOTE_JOBS, wait_for, write_spec
from helpers.local_sshd import SSHD, LocalSshd, local_sshd
from helpers.terminal import run_on_a_terminal

from nebula_cli.transport.openssh.transport import OpenSSHTransport
from nebula_cli.transport.ssh.transport import AuthError, SSHTransport

PAM_OATH = Path("/lib/x86_64-linux-gnu/security/pam_oath.so")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SSHD) or shutil.which("ssh") is None
    or shutil.which("oathtool") is None or not PAM_OATH.exists()
    or shutil.which("unshare") is None,
    reason="needs root, openssh-server and client, libpam-oath and oathtool")


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


def test_nebulas_own_client_names_the_openssh_transport(otp_host: OtpHost) -> None:
    """paramiko's client gets past the key, then the host wants a code: one error naming the
    host and `transport: openssh`."""
    t = SSHTransport("otp-login", ssh_config=str(otp_host.config),
                     known_hosts=str(otp_host.server.known_hosts), connect_timeout=5.0)
    with pytest.raises(AuthError) as caught:
        t.run(["true"])
    assert caught.value.host == "otp-login" and "transport: openssh" in str(caught.value)
    assert "one-time code" in str(caught.value)


@pytest.mark.slow
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
