"""Files and folders nebula writes on hosts are never readable by other users before their
mode says so (nebula_cli.transport.sshfiles, execfiles, local): a key written over SFTP is
created 0600 by the server (its mode travels in SFTP's OPEN), one written over exec channels is
created under umask 077, and every folder nebula makes is 0700, parents included. Against a
real sshd on 127.0.0.1, with and without the SFTP subsystem.

REALWORLD rows: hosts shared with other users; login nodes without SFTP (hardened HPC)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
from helpers.local_sshd import SSHD, local_sshd

from nebula_cli.transport.local.transport import LocalTransport

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a test sshd"),
    pytest.mark.skipif(not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None,
                       reason="needs openssh-server (/usr/sbin/sshd) and ssh-keygen"),
]


@pytest.fixture
def remote_dir() -> Iterator[Path]:
    """A new folder under root's home (where the test sshd's sessions write), removed after."""
    home = Path(pwd.getpwuid(0).pw_dir)
    path = home / f".nebula-files-{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def modes(root: Path) -> dict[str, int]:
    """Mode bits of every folder from `root` down, by relative path."""
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.stat().st_mode)
            for p in [root, *root.rglob("*")] if p.is_dir()}


def test_a_key_over_sftp_is_created_0600_before_a_byte_is_written(
        tmp_path: Path, remote_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real_chmod = paramiko.SFTPFile.chmod

    def observed(fh: paramiko.SFTPFile, mode: int) -> None:
        # the temporary file as it is on the host before nebula gives it its mode
        tmp = next(remote_dir.rglob(".key.pem.*.tmp"))
        seen.append(stat.S_IMODE(tmp.stat().st_mode))
        real_chmod(fh, mode)

    monkeypatch.setattr(paramiko.SFTPFile, "chmod", observed)
    with local_sshd(tmp_path, sftp=True) as sshd, sshd.transport() as t:
        t.put_bytes(b"secret", f"{remote_dir}/certs/deep/key.pem", mode=0o600)
        t.makedirs(f"{remote_dir}/logs/a")
    key = remote_dir / "certs/deep/key.pem"
    assert key.read_bytes() == b"secret" and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert seen == [0o600]  # never 0644 (the server's default) with the data on its way
    assert set(modes(remote_dir).values()) == {0o700}, modes(remote_dir)


def test_a_key_over_exec_channels_is_never_readable_by_others(
        tmp_path: Path, remote_dir: Path) -> None:
    """Without SFTP: a 24 MB key file (so that its temporary file exists a while) is watched
    as it is written: its temporary file is 0600 from the start."""
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for tmp in remote_dir.rglob(".*.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    seen.add(stat.S_IMODE(tmp.stat().st_mode))

    watcher = threading.Thread(target=watch, daemon=True)
    data = os.urandom(24 << 20)
    with local_sshd(tmp_path, sftp=False) as sshd, sshd.transport() as t:
        watcher.start()
        try:
            t.put_bytes(data, f"{remote_dir}/certs/key.pem", mode=0o600)
        finally:
            done.set()
            watcher.join(10)
        t.makedirs(f"{remote_dir}/logs/a")
        t.upload_tree(str(Path(__file__).parent), f"{remote_dir}/work")
    key = remote_dir / "certs/key.pem"
    assert key.read_bytes() == data and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert seen == {0o600}, sorted(f"{m:o}" for m in seen)
    assert set(modes(remote_dir).values()) == {0o700}, modes(remote_dir)


def test_local_folders_are_0700_parents_included(tmp_path: Path) -> None:
    t = LocalTransport("here", home=str(tmp_path / "home"))
    old = os.umask(0o022)
    try:
        t.put_bytes(b"secret", str(tmp_path / "home/.nebula/jobs/j1/certs/key.pem"), mode=0o600)
        t.makedirs(str(tmp_path / "home/.nebula/netbench/run1/lib"))
        src = tmp_path / "key-src"
        src.write_bytes(b"k")
        t.put(str(src), str(tmp_path / "home/.nebula/jobs/j1/other/key"), mode=0o600)
    finally:
        os.umask(old)
    assert set(modes(tmp_path / "home").values()) == {0o700}, modes(tmp_path / "home")
    for key in ("jobs/j1/certs/key.pem", "jobs/j1/other/key"):
        assert stat.S_IMODE((tmp_path / "home/.nebula" / key).stat().st_mode) == 0o600
