"""SSHTransport against real sshd processes on 127.0.0.1 (one target, one jump host)."""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers.sshd_bed import (
    NEEDS_SSHD,
    Bed,
    free_port,
)

from nebula_cli.errors import CommandFailed, TransportError
from nebula_cli.transport.hostkeys import fingerprint
from nebula_cli.transport.ssh.transport import (
    AuthError,
    ChangedHostKey,
    SSHTimeout,
    UnknownHostKey,
    UnreachableError,
)

pytestmark = NEEDS_SSHD


def ssh_keygen_fingerprint(pub: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(pub)], check=True,
                         capture_output=True, text=True, timeout=30).stdout
    return out.split()[1]


# --- commands --------------------------------------------------------------------------------

def test_run_env_cwd_stdin_and_exit_codes(bed: Bed) -> None:
    with bed.transport() as t:
        assert t.connection is None  # lazy: nothing opened yet
        result = t.run(["sh", "-c", 'printf "%s|%s|" "$FOO" "$PWD"; cat; echo oops >&2; exit 3'],
                       env={"FOO": "a b'c $HOME"}, cwd="/tmp", stdin=b"from stdin")
        assert result.exit_code == 3 and not result.ok
        assert result.stdout == "a b'c $HOME|/tmp|from stdin"
        assert result.stderr == "oops\n"
        shell = t.run('echo "$X" && echo "$X" two', env={"X": "1"})
        assert shell.ok and shell.stdout == "1\n1 two\n"
        home = pwd.getpwuid(0).pw_dir
        assert t.run("pwd", cwd="~").stdout.strip() == home
        assert t.home == f"{home}/.nebula" and t.python == "python3"
        missing = t.run(["nebula-no-such-python", "-V"])
        assert missing.exit_code == 127 and "not found" in missing.stderr
        with pytest.raises(CommandFailed) as failed:
            t.run_checked(["false"])
        assert failed.value.host == "target"
        with pytest.raises(TransportError, match="invalid environment variable"):
            t.run(["true"], env={"BAD NAME": "x"})
    assert t.connection is None
    t.close()  # idempotent


def test_large_stdout_and_stderr_do_not_deadlock(bed: Bed) -> None:
    size = 10_000_000
    with bed.transport() as t:
        start = time.monotonic()
        result = t.run(
            f"(head -c {size} /dev/zero | tr '\\0' o) & (head -c {size} /dev/zero | tr '\\0' e)"
            " >&2; wait", timeout=60)
        assert result.ok, result
        assert len(result.stdout) == size and len(result.stderr) == size
        assert set(result.stdout) == {"o"} and set(result.stderr) == {"e"}
        assert time.monotonic() - start < 30


def test_command_timeout_closes_channel(bed: Bed) -> None:
    pidfile = bed.dir / "sleeper.pid"
    with bed.transport() as t:
        start = time.monotonic()
        try:
            with pytest.raises(SSHTimeout, match="did not finish within 1 s"):
                t.run(f"echo $$ > {pidfile}; exec sleep 30", timeout=1)
        finally:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
        assert time.monotonic() - start < 4
        assert t.run(["echo", "still usable"]).stdout == "still usable\n"


def test_one_connection_shared_by_threads(bed: Bed) -> None:
    before = bed.target.accepted()
    with bed.transport() as t:
        t.put_bytes(b"shared\n", f"{bed.remote_dir}/shared.txt")
        conn = t.connection
        errors: list[BaseException] = []
        outputs: list[str] = []

        def work(i: int) -> None:
            try:
                for j in range(5):
                    outputs.append(t.run(["echo", f"{i}-{j}"]).stdout.strip())
                    assert t.read_file(f"{bed.remote_dir}/shared.txt") == b"shared\n"
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(10)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        assert sorted(outputs) == sorted(f"{i}-{j}" for i in range(10) for j in range(5))
        assert t.connection is conn
    assert bed.target.accepted() - before == 1


def test_dropped_connection_reopens_on_next_use(bed: Bed) -> None:
    before = bed.target.accepted()
    with bed.transport() as t:
        assert t.exists("/")
        first = t.connection
        assert first is not None
        first.close()  # as if the network dropped it
        assert t.run(["echo", "again"]).stdout == "again\n" and t.exists("/")
        assert t.connection is not None and t.connection is not first
    assert bed.target.accepted() - before == 2


# --- files -----------------------------------------------------------------------------------

def test_files_with_home_relative_paths(bed: Bed, tmp_path: Path) -> None:
    base = f"{bed.remote_dir}/files"
    home = pwd.getpwuid(0).pw_dir
    with bed.transport() as t:
        absolute = t.remote_path(base)
        assert absolute == f"{home}/{bed.remote_dir[2:]}/files"
        assert t.remote_path("/abs/x") == "/abs/x"
        assert not t.exists(base)
        t.makedirs(f"{base}/a/b", mode=0o750)
        assert t.exists(f"{base}/a/b") and Path(absolute, "a/b").is_dir()
        t.makedirs(f"{base}/a/b")  # exists already: fine

        t.put_bytes(b"secret", f"{base}/deep/new/key.pem", mode=0o600)
        on_disk = Path(absolute, "deep/new/key.pem")
        assert on_disk.read_bytes() == b"secret" and on_disk.stat().st_mode & 0o777 == 0o600
        t.put_bytes(b"replaced", f"{base}/deep/new/key.pem", mode=0o600)
        assert on_disk.read_bytes() == b"replaced"
        assert [p.name for p in on_disk.parent.iterdir()] == ["key.pem"]  # no temp files left

        local = tmp_path / "script.sh"
        local.write_bytes(b"#!/bin/sh\necho hi\n" * 1000)
        local.chmod(0o755)
        t.put(str(local), f"{base}/script.sh")
        assert Path(absolute, "script.sh").stat().st_mode & 0o777 == 0o755
        t.put(str(local), f"{base}/script.sh", mode=0o700)
        assert Path(absolute, "script.sh").stat().st_mode & 0o777 == 0o700
        back = tmp_path / "back.sh"
        t.get(f"{base}/script.sh", str(back))
        assert back.read_bytes() == local.read_bytes()
        with pytest.raises(TransportError, match="target: cannot copy"):
            t.get(f"{base}/missing", str(tmp_path / "never"))
        assert not (tmp_path / "never").exists()
        with pytest.raises(TransportError, match="cannot copy"):
            t.put(str(tmp_path / "no-such-file"), f"{base}/x")

        log = f"{base}/log.txt"
        assert t.read_tail(log, 7) == (b"", 7)
        assert t.read_file(log) is None
        t.put_bytes(b"line1\nline2\n", log)
        assert t.read_tail(log, 0) == (b"line1\nline2\n", 12)
        assert t.read_tail(log, 6, max_bytes=3) == (b"lin", 9)
        assert t.read_tail(log, 12) == (b"", 12)
        t.put_bytes(b"new\n", log)  # replaced by a shorter file: read from the start
        assert t.read_tail(log, 12) == (b"new\n", 4)
        big = os.urandom(3 << 20)
        t.put_bytes(big, log)
        assert t.read_tail(log, 1000, max_bytes=2 << 20) == (big[1000:1000 + (2 << 20)],
                                                              1000 + (2 << 20))
        assert t.read_file(log) == big


def test_upload_tree_skips_unchanged_and_honours_excludes(bed: Bed, tmp_path: Path) -> None:
    src = tmp_path / "work"
    for rel, data in {
        "train.py": b"print('train')\n", "pkg/__init__.py": b"", "pkg/model.py": b"x = 1\n" * 500,
        "pkg/model.pyc": b"compiled", "pkg/__pycache__/model.cpython-311.pyc": b"c",
        ".git/HEAD": b"ref", ".venv/bin/python": b"bin", "data/empty/.keep": b"",
    }.items():
        Path(src, rel).parent.mkdir(parents=True, exist_ok=True)
        Path(src, rel).write_bytes(data)
    remote = f"{bed.remote_dir}/sync"
    calls: list[tuple[int, int]] = []
    with bed.transport() as t:
        sent = t.upload_tree(str(src), remote, exclude=[".git", ".venv", "__pycache__", "*.pyc"],
                          progress=lambda done, total: calls.append((done, total)))
        expected = len(b"print('train')\n") + len(b"x = 1\n" * 500)
        assert sent == (4, expected)
        assert calls and calls[-1] == (expected, expected)
        root = Path(t.remote_path(remote))
        found = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        assert found == ["data/empty/.keep", "pkg/__init__.py", "pkg/model.py", "train.py"]
        assert Path(root, "pkg/model.py").stat().st_mtime == int(
            Path(src, "pkg/model.py").stat().st_mtime)

        assert t.upload_tree(str(src), remote, exclude=["*.pyc", ".git", ".venv",
                                                     "__pycache__"]) == (0, 0)
        Path(src, "train.py").write_bytes(b"print('changed')\n")
        os.utime(Path(src, "train.py"), (time.time() + 5, time.time() + 5))
        assert t.upload_tree(str(src), remote, exclude=["*.pyc", ".git", ".venv",
                                                     "__pycache__"]) == (1, 17)
        assert Path(root, "train.py").read_bytes() == b"print('changed')\n"


# --- host keys -------------------------------------------------------------------------------

def test_unknown_host_key_refused_with_fingerprint(bed: Bed, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    with pytest.raises(UnknownHostKey) as info:
        bed.transport(known_hosts=str(empty)).run(["true"])
    message = str(info.value)
    expected = ssh_keygen_fingerprint(bed.target.host_key.with_suffix(".pub"))
    assert message.startswith("target: unknown host key for ")
    assert f"[127.0.0.1]:{bed.target.port}" in message and expected in message
    assert f"ssh-keyscan -p {bed.target.port} 127.0.0.1 >> {empty}" in message
    assert "--accept-new-host-keys" in message
    assert not empty.exists()  # nothing recorded


def test_accept_new_records_key_then_refuses_changed_key(bed: Bed, tmp_path: Path) -> None:
    known = tmp_path / "ssh" / "known_hosts"
    with bed.transport(known_hosts=str(known), accept_new_host_keys=True) as t:
        assert t.run(["true"]).ok
    assert known.read_text() == bed.target.known_line()
    with bed.transport(known_hosts=str(known)) as t:  # now known without accept-new
        assert t.run(["true"]).ok
    # The recorded key for [127.0.0.1]:port is now a different server's key.
    known.write_text(bed.jump.known_line(port=bed.target.port))
    with pytest.raises(ChangedHostKey) as info:
        bed.transport(known_hosts=str(known), accept_new_host_keys=True).run(["true"])
    message = str(info.value)
    assert "HOST KEY CHANGED" in message and message.startswith("target: ")
    assert ssh_keygen_fingerprint(bed.jump.host_key.with_suffix(".pub")) in message  # old
    assert ssh_keygen_fingerprint(bed.target.host_key.with_suffix(".pub")) in message  # new
    assert known.read_text() == bed.jump.known_line(port=bed.target.port)  # untouched


def test_hashed_known_hosts_entry_accepted(bed: Bed, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(bed.target.known_line())
    subprocess.run(["ssh-keygen", "-H", "-f", str(known)], check=True, capture_output=True,
                   timeout=30)
    assert known.read_text().startswith("|1|")
    with bed.transport(known_hosts=str(known)) as t:
        assert t.run(["true"]).ok


def test_fingerprint_matches_openssh(bed: Bed) -> None:
    import paramiko

    key = paramiko.PKey.from_path(str(bed.target.host_key))
    assert fingerprint(key) == ssh_keygen_fingerprint(bed.target.host_key.with_suffix(".pub"))


# --- failures --------------------------------------------------------------------------------

def test_wrong_key_is_auth_error(bed: Bed) -> None:
    with pytest.raises(AuthError) as info:
        bed.transport(key=str(bed.wrong_key)).run(["true"])
    message = str(info.value)
    assert message.startswith("target: authentication failed for root@127.0.0.1:")
    assert str(bed.wrong_key) in message


def test_connection_refused_is_unreachable_quickly(bed: Bed) -> None:
    start = time.monotonic()
    with pytest.raises(UnreachableError, match="target: connection refused by 127.0.0.1:"):
        bed.transport(port=free_port()).run(["true"])
    assert time.monotonic() - start < 2


def test_silent_server_times_out(bed: Bed) -> None:
    with socket.socket() as silent:  # accepts TCP, never speaks SSH
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        start = time.monotonic()
        with pytest.raises(SSHTimeout, match="target: SSH handshake with .* timed out"):
            bed.transport(port=silent.getsockname()[1], connect_timeout=1.0).run(["true"])
        assert time.monotonic() - start < 4
