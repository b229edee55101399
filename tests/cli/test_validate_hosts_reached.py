"""`nebula validate --hosts` says, per host, how it was reached: the address, the ProxyJump or
ProxyCommand, the ssh_config lines that applied (file:line, from `ssh -G`) and the
authentication used; a host that cannot be reached is one error naming it and its proxy.
Against a real sshd on 127.0.0.1 (cli/app.py, control/hostcheck.py, transport/sshconfig.py).

REALWORLD rows (SSH): `~/.ssh/config` with wildcard `Host` blocks and a key with a
non-default name; `ProxyCommand` (cloud CLIs' tunnels)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers.jobs import CLI, write_spec
from helpers.local_sshd import SSHD, local_sshd

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SSHD) or shutil.which("ssh") is None,
    reason="needs root, openssh-server and OpenSSH's client")


def test_each_host_says_how_it_was_reached(cli: CLI, tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with local_sshd(tmp_path / "d", sftp=True) as server:
        key = tmp_path / "lab_key"
        shutil.copy(server.user_key, key)
        config = tmp_path / "ssh_config"
        config.write_text(
            f"Host lab-*\n  HostName 127.0.0.1\n  Port {server.port}\n  User root\n"
            f"  IdentityFile {key}\n  IdentitiesOnly yes\n"
            "Host cloud-vm\n  ProxyCommand /bin/false %h\n")
        cli.env["NEBULA_SSH_CONFIG"] = str(config)
        cli.env["NEBULA_KNOWN_HOSTS"] = str(server.known_hosts)
        spec = write_spec(tmp_path, f"""\
            name: reach
            run: echo hi
            clusters:
              - name: lab
                python: {sys.executable}
                hosts: [lab-gpu1]
              - name: cloud
                hosts: [cloud-vm]
            """)
        proc = cli("validate", str(spec), "--hosts", timeout=180)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1, out
    assert (f"lab/lab-gpu1: nebula's ssh to root@127.0.0.1:{server.port}; ssh_config read by "
            f"ssh -G from {config}: {config}:1 (lab-*)") in out
    assert f"auth publickey: {key}" in out
    assert "cloud/cloud-vm: nebula's ssh to" in out
    assert "via ProxyCommand `/bin/false cloud-vm`" in out
    assert "error: cloud/cloud-vm:" in out
    assert "the ProxyCommand `/bin/false cloud-vm` exited 1" in out
