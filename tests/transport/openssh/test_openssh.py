"""transport/openssh/transport.py: the masters' control folder is used only when it is this user's
own folder (0700, no symlink): one planted by another user, or a symlink, is refused before any
socket in it is trusted or any `ssh` is started, with one error naming the host and the fix; a
missing one is made 0700 and works. A real sshd, the real `ssh` client, a real other user
(nobody)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.local_sshd import SSHD, LocalSshd, local_sshd

from nebula_cli.errors import TransportError
from nebula_cli.transport.openssh.transport import OpenSSHTransport

OTHER_UID = 65534  # nobody
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SSHD) or shutil.which("ssh") is None,
    reason="needs root, openssh-server and client")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LocalSshd]:
    (tmp_path / "d").mkdir()
    with local_sshd(tmp_path / "d", sftp=False) as sshd:
        yield sshd


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder of /tmp with a short name (a socket path has at most 104 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="nc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("planted", ["another user's folder", "a symlink", "nothing"])
def test_the_control_folder_must_be_this_users_own(server: LocalSshd, short_dir: Path,
                                                   planted: str) -> None:
    control = short_dir / "ssh"
    if planted == "another user's folder":
        control.mkdir(mode=0o777)
        os.chown(control, OTHER_UID, OTHER_UID)
    elif planted == "a symlink":
        (short_dir / "elsewhere").mkdir(mode=0o700)
        control.symlink_to(short_dir / "elsewhere")
    t = OpenSSHTransport("login1", "127.0.0.1", user="root", port=server.port,
                         key=str(server.user_key), known_hosts=str(server.known_hosts),
                         ssh_config=str(server.dir / "no_config"), connect_timeout=5.0,
                         control_dir=str(control))
    try:
        if planted == "nothing":
            assert t.run(["echo", "reached"]).stdout.strip() == "reached"
            info = os.lstat(control)
            assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
            return
        with pytest.raises(TransportError) as err:
            t.run(["echo", "reached"])
        said = str(err.value)
        assert "login1" in said and f"control folder {control}" in said, said
        assert ("belongs to another user (uid 65534)" if planted.startswith("another")
                else "is a symlink") in said
        assert f"rm -r {control}" in said
        assert "Accepted publickey" not in server.log.read_text(errors="replace")  # no ssh
        if planted.startswith("another"):
            assert os.lstat(control).st_uid == OTHER_UID  # left as it was, not taken over
    finally:
        t.exit_master()
