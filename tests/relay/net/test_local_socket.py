"""The relay's Unix socket (`nebula_cli.relay.net.local_socket`) as a worker meets it: a worker
talks only to a process of its own user (SO_PEERCRED), sending nothing to another's socket found
where the relay's should be (another user is a real uid: nobody). The relay's side (it refuses
another uid) is tested with a real relay in tests/test_relay_local.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from nebula_cli.relay.net import local_socket

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to act as another user")
SQUATTER = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1]); s.listen(); s.settimeout(20)
print("ready", flush=True)
conn, _ = s.accept(); conn.settimeout(5)
got = b""
try:
    while chunk := conn.recv(4096):
        got += chunk
except OSError:
    pass
print("got", len(got), flush=True)
"""


def test_a_worker_sends_nothing_to_another_users_socket(tmp_path: Path) -> None:
    open_dir = Path(tempfile.mkdtemp(prefix="nebula-squat-", dir="/tmp"))
    open_dir.chmod(0o777)
    fake = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                             sys.executable, "-c", textwrap.dedent(SQUATTER),
                             str(open_dir / "s")], stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout is not None and fake.stdout.readline().strip() == "ready"
        job = tmp_path / "job"
        job.mkdir(mode=0o700)
        path = job / "worker.sock"
        (open_dir / "s").rename(path)  # where the relay's socket would be
        with pytest.raises(PermissionError, match="served by uid 65534, not by this user's"):
            local_socket.connect(str(path), timeout=5)
        said, _ = fake.communicate(timeout=30)
        assert said.strip() == "got 0"  # not a byte: no hello, no job id
    finally:
        fake.kill()
        fake.wait(10)
        shutil.rmtree(open_dir, ignore_errors=True)
    # the relay's own socket (this user's): connected
    path = tmp_path / "job" / "relay.sock"
    server = local_socket.listen(str(path))
    try:
        conn = local_socket.connect(str(path), timeout=5)
        assert local_socket.peer_uid(conn.sock) == os.getuid()
        conn.sock.close()
    finally:
        server.close()
