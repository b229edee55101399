"""A key protected by a passphrase and not in the agent (transport/keyfiles.py): asked once per
process on the terminal (a pseudo-terminal the test types into), used for every connection
after; without a terminal, one error naming the key and `ssh-add`. Against a real sshd.

REALWORLD row (SSH): passphrase-protected keys."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.local_sshd import SSHD, local_sshd
from helpers.terminal import run_on_a_terminal

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None,
    reason="needs root, openssh-server and ssh-keygen")

CHILD = """
import sys
from nebula_cli.transport.ssh.transport import SSHTransport
port, key, known, nocfg = sys.argv[1:]
for i in range(2):
    t = SSHTransport("enc", "127.0.0.1", user="root", port=int(port), key=key,
                     known_hosts=known, ssh_config=nocfg, connect_timeout=5.0)
    try:
        print(t.run(["echo", f"run{i}"]).stdout.strip(), "by", t.auth_method, flush=True)
    except Exception as exc:
        print("failed:", exc, flush=True)
    finally:
        t.close()
"""


def test_a_passphrase_is_asked_once_and_never_without_a_terminal(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with local_sshd(tmp_path / "d", sftp=True) as server:
        key = tmp_path / "locked_key"
        shutil.copy(server.user_key, key)
        subprocess.run(["ssh-keygen", "-q", "-p", "-N", "open sesame", "-f", str(key)],
                       check=True, capture_output=True, timeout=30)
        argv = [sys.executable, "-c", CHILD, str(server.port), str(key),
                str(server.known_hosts), str(tmp_path / "no_config")]
        env = {**os.environ, "NO_COLOR": "1"}
        code, shown = run_on_a_terminal(argv, env, lambda: "open sesame",
                                        prompt=b"Passphrase for", timeout=60)
        assert code == 0, shown
        assert shown.count("Passphrase for") == 1, shown
        assert f"run0 by publickey: {key}" in shown and f"run1 by publickey: {key}" in shown
        plain = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL, env=env)
    said = " ".join(plain.stdout.split())
    assert said.count("failed:") == 2 and "Passphrase" not in plain.stderr
    assert f"{key} (encrypted and no terminal to ask on: `ssh-add {key}`" in said
