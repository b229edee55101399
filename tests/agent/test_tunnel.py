"""The relay's SSH tunnels (`nebula_cli.agent.tunnel`) against a real sshd on 127.0.0.1: the key
line a relay grants (and takes back), the ssh per connection its peer's local end starts, and a
target the key may not reach. (What else the key may not do: tests/agent/test_grants.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.jobs import REPO, wait_for
from helpers.sshd_bed import SSHD, Sshd, descendants, start_sshd

from nebula_cli.agent import authkeys, tunnel
from nebula_cli.config import strict
from nebula_cli.config.tunnel_config import TunnelConfig, TunnelDial, TunnelGrant
from nebula_cli.pki import ssh_keypair
from nebula_cli.relay.net import local_socket

needs_sshd = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SSHD),
                                reason="needs root and openssh-server for a test sshd")


def test_key_lines_are_added_and_removed_beside_the_others(tmp_path: Path) -> None:
    path = tmp_path / "ssh" / "authorized_keys"
    assert not authkeys.remove_tagged(str(path), ["x"])  # nothing there: nothing made
    assert not path.parent.exists()
    mine = "ssh-ed25519 AAAAmine user@laptop"
    authkeys.add_lines(str(path), [mine])
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    path.chmod(0o640)  # a mode of its own is kept
    a = "restrict ssh-ed25519 AAAAa nebula-tunnel:job1:x>y"
    b = "restrict ssh-ed25519 AAAAb nebula-tunnel:job1:z>y"
    other_job = "restrict ssh-ed25519 AAAAc nebula-tunnel:job2:x>y"
    assert authkeys.add_lines(str(path), [a, b, other_job])
    assert not authkeys.add_lines(str(path), [a])  # the same line again: no change
    newer = a.replace("AAAAa", "AAAAn")
    authkeys.add_lines(str(path), [newer])  # one line per tag: replaced
    assert path.read_text().splitlines() == [mine, newer, b, other_job]
    assert path.stat().st_mode & 0o777 == 0o640
    authkeys.remove_tagged(str(path), prefix="nebula-tunnel:job1:")
    assert path.read_text().splitlines() == [mine, other_job]
    authkeys.remove_tagged(str(path), ["nebula-tunnel:job2:x>y"])
    assert path.read_text() == mine + "\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["authorized_keys"]
    # sshd_config's tokens, as a site's AuthorizedKeysFile may use them
    (tmp_path / "keys" / pwd.getpwuid(os.getuid()).pw_name).mkdir(parents=True)
    authkeys.add_lines(str(tmp_path / "keys" / "%u" / "ak%%1"), [a])
    assert (tmp_path / "keys" / pwd.getpwuid(os.getuid()).pw_name / "ak%1").read_text() == a + "\n"


@contextlib.contextmanager
def echo_server() -> Iterator[int]:
    """A TCP echo server on 127.0.0.1 (the relay's stand-in); its port."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(conn.recv(100))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        server.close()


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[tuple[Sshd, Path]]:
    """A test sshd on 127.0.0.1 whose AuthorizedKeysFile holds one line of its own."""
    keys = tmp_path / "authorized_keys"
    keys.write_text("ssh-ed25519 AAAAsomeoneelse admin@site\n")
    server = start_sshd(tmp_path, "tunnelled", keys)
    try:
        yield server, keys
    finally:
        server.stop()


def _config(tmp_path: Path, server: Sshd, keys: Path, targets: dict[str, int]
            ) -> tuple[TunnelConfig, dict[str, str]]:
    """A config that grants (on the test sshd) and dials (through it) one tunnel per target:
    peer -> the relay port it may forward to. Also: peer -> its tunnel's local end (a socket
    file)."""
    (tmp_path / "known_hosts").write_text(f"nebula-test-alias {server.pub_line}\n")
    dial, grant, local = [], [], {}
    for peer, port in targets.items():
        private, public = ssh_keypair()
        key = tmp_path / f"{peer}.key"
        key.write_bytes(private)
        key.chmod(0o600)
        local[peer] = str(tmp_path / "tunnels" / f"{peer}.sock")
        tag = f"nebula-tunnel:job-t:{peer}>here"
        grant.append(TunnelGrant(peer=peer, authorized_keys=str(keys), tag=tag,
                                 public_key=public, targets=[f"127.0.0.1:{port}"],
                                 expires=2**31 - 1))
        dial.append(TunnelDial(peer=peer, listen=local[peer],
                               target=f"127.0.0.1:{port}", host="127.0.0.1", port=server.port,
                               user="root", key=str(key), known_hosts=str(tmp_path /
                                                                          "known_hosts"),
                               alias="nebula-test-alias",
                               log=str(tmp_path / "logs" / f"tunnel-{peer}.log")))
    cfg = TunnelConfig(job_id="job-t", cluster="here", keepalive=1, keepalive_count=3,
                       grant_ttl=900, dial=dial, grant=grant)
    strict.write(cfg, tmp_path / "tunnels.json")
    return cfg, local


def _run(tmp_path: Path, command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "nebula_cli.agent.tunnel", "run", "--config",
         str(tmp_path / "tunnels.json"), "--", *command], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)


CLIENT = """
import json, socket, sys, time
out = {}
for name, path in json.loads(sys.argv[1]).items():
    deadline = time.monotonic() + 20
    while name not in out:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(path)
                s.sendall(b"ping")
                out[name] = s.recv(100).decode()
        except (ConnectionRefusedError, FileNotFoundError):  # the local end is not up yet
            if time.monotonic() > deadline:
                out[name] = "no tunnel"
            time.sleep(0.2)
        except OSError:  # accepted, then closed by ssh: the far end refused the target
            out[name] = ""
print(json.dumps(out), flush=True)
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)  # the relay lives on a while
"""


@needs_sshd
def test_a_tunnel_reaches_its_target_only_and_leaves_nothing(
        tmp_path: Path, sshd: tuple[Sshd, Path]) -> None:
    server, keys = sshd
    before = keys.read_text()
    with echo_server() as relay_port, echo_server() as other_port:
        # "denied": a key allowed to reach relay_port only, asked for another port
        cfg, local = _config(tmp_path, server, keys, {"east": relay_port, "denied": relay_port})
        cfg.dial[1] = TunnelDial(**{**cfg.dial[1].__dict__, "target": f"127.0.0.1:{other_port}"})
        strict.write(cfg, tmp_path / "tunnels.json")
        proc = _run(tmp_path, [sys.executable, "-c", CLIENT, json.dumps(local), "1.0"])
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    said = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert said == {"east": "ping", "denied": ""}, out
    # the key of the tunnel that worked is pinned to where its session came from
    assert 'key of the tunnel from east pinned to from="127.0.0.1"' in out, out
    assert "tunnel from denied pinned" not in out
    assert "tunnel keys removed from" in out
    assert "tunnel to denied: ssh: nebula-bridge: '127.0.0.1:" in out, out
    assert "is not a target this key may reach" in out
    assert "tunnel to east: ssh:" not in out, out  # a working tunnel says nothing
    assert keys.read_text() == before  # the grants went away, the site's own line stayed
    assert "Accepted publickey" in server.log.read_text()
    assert not [p for p in descendants(os.getpid()) if _cmd(p).startswith("ssh ")]


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@needs_sshd
def test_a_killed_ssh_ends_its_connection_only_and_a_signal_ends_all(
        tmp_path: Path, sshd: tuple[Sshd, Path]) -> None:
    server, keys = sshd
    with echo_server() as relay_port:
        _, local = _config(tmp_path, server, keys, {"east": relay_port})
        proc = _run(tmp_path, [sys.executable, "-c", "import time; time.sleep(300)"])
        try:
            wait_for(lambda: _works_unix(Path(local["east"])), timeout=20)
            wait_for(lambda: not _ssh_pids(proc.pid), timeout=10)  # each ends with its use
            with local_socket.connect(local["east"], timeout=10).sock as held:
                first = wait_for(lambda: _ssh_pids(proc.pid), timeout=10)
                os.kill(first[0], signal.SIGKILL)  # its client dies (a cut, an OOM kill)
                assert held.recv(100) == b""  # that connection ends, the relay dials again
            assert wait_for(lambda: _works_unix(Path(local["east"])), timeout=20)
            assert "nebula-tunnel:job-t:east>here" in keys.read_text()
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM, out  # ended as the command did: by SIGTERM
    assert f"tunnel to east up: {local['east']} -> 127.0.0.1:" in out
    assert "tunnel to east through root@127.0.0.1" in out and "ended (exit -9)" in out, out
    assert "nebula-tunnel" not in keys.read_text()
    assert not _ssh_pids(proc.pid)


def _ssh_pids(wrapper: int) -> list[int]:
    return [p for p in descendants(wrapper) if _cmd(p).startswith("ssh ")]


def test_ssh_missing_on_the_host_is_one_line(tmp_path: Path) -> None:
    cfg = TunnelConfig(job_id="j", cluster="lab", keepalive=5, keepalive_count=3,
                       grant_ttl=900, grant=[],
                       dial=[TunnelDial(peer="hpc", listen=str(tmp_path / "hpc.sock"),
                                        target="127.0.0.1:2",
                                        host="h", port=22, user="u", key="k", known_hosts="k",
                                        alias="a", log=str(tmp_path / "l"))])
    strict.write(cfg, tmp_path / "tunnels.json")
    env = {**os.environ, "PATH": str(tmp_path)}  # no ssh on it
    proc = subprocess.run([sys.executable, "-m", "nebula_cli.agent.tunnel", "run", "--config",
                           str(tmp_path / "tunnels.json"), "--", "true"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 127
    assert "ssh not found on this host (install openssh-client): relay lab cannot reach hpc" \
        in proc.stdout


def test_ssh_messages_are_echoed_and_their_file_stays_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A month of reconnections writes ssh's messages again and again: once LOG_BOUND bytes of
    them were echoed into the relay's log, the file is emptied, and what comes after is still
    echoed (an appending writer goes on at the new end)."""
    monkeypatch.setattr(tunnel, "LOG_BOUND", 4096)
    log = tmp_path / "ssh.log"
    dial = TunnelDial(peer="hpc", listen=str(tmp_path / "hpc.sock"), target="127.0.0.1:2",
                      host="h", port=22,
                      user="u", key="k", known_hosts="k", alias="a", log=str(log))
    t = tunnel.Tunnel(dial, keepalive=5, count=3)
    with open(log, "ab") as ssh_stderr:  # as a session's ssh holds it
        for i in range(200):
            ssh_stderr.write(f"Connection to h closed by remote host ({i}).\n".encode())
            ssh_stderr.flush()
            t.echo()
            assert log.stat().st_size <= 4096 + 64
        said = capsys.readouterr().out.splitlines()
        assert len(said) == 200 and said[-1].endswith("(199).")
        assert "tunnel to hpc: ssh: Connection to h closed by remote host (0)." in said[0]
        ssh_stderr.write(b"Permission denied (publickey).\n")
        ssh_stderr.flush()
        t.echo()
    assert capsys.readouterr().out.strip().endswith("ssh: Permission denied (publickey).")


OTHER_USER = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    head, name = os.path.split(sys.argv[1])
    fd = os.open(head, os.O_PATH | os.O_DIRECTORY)
    s.connect(f"/proc/self/fd/{fd}/{name}")
except OSError as exc:
    print(f"refused: {exc.strerror}")
    sys.exit(0)
try:
    s.sendall(b"ping")
    got = s.recv(100)
except OSError:  # closed with the ping unread: a reset
    got = b""
print(f"answered: {got!r}" if got else "closed")
"""


def _other_user(path: Path) -> str:
    """What a process of user nobody gets from the socket file at `path` (through its
    folder's /proc/self/fd entry when the path is too long to connect to)."""
    proc = subprocess.run(["/usr/bin/python3", "-c", OTHER_USER, str(path)], user="nobody",
                          capture_output=True, text=True, timeout=30)
    return proc.stdout.strip() or proc.stderr.strip()


def _works_unix(path: Path) -> bool:
    with contextlib.suppress(OSError):
        conn = local_socket.connect(str(path), timeout=5)  # as the relay dials it
        with conn.sock as s:
            s.sendall(b"ping")
            return s.recv(100) == b"ping"
    return False


@needs_sshd
def test_a_relays_local_end_is_a_socket_file_only_its_user_reaches(
        tmp_path: Path, sshd: tuple[Sshd, Path]) -> None:
    """The review's case: on a loopback port, any user of the dialling host (a login node) could
    hold the tunnel's sessions or drive logins with the job's key. The job's local end is a
    socket file in the relay's 0700 agent folder: another user cannot connect, and one that
    could (a folder made open) is closed before any ssh starts. The path is longer than
    sun_path holds (bound and dialled through /proc/self/fd)."""
    server, keys = sshd
    base = Path(tempfile.mkdtemp(prefix="nebula-tunnel-test-", dir="/tmp"))
    try:
        base.chmod(0o755)  # nobody may walk down to the agent folder, as to a home directory
        agent = base / ("long-job-directory-" * 4) / "lab" / "l1" / "relay"
        agent.mkdir(parents=True)
        for d in (agent, agent.parent, agent.parent.parent, agent.parent.parent.parent):
            d.chmod(0o755)
        local_end = agent / "tunnels" / "east.sock"
        assert len(os.fsencode(local_end)) > 108
        with echo_server() as relay_port:
            cfg, _ = _config(tmp_path, server, keys, {"east": relay_port})
            cfg.dial[0] = TunnelDial(**{**cfg.dial[0].__dict__, "listen": str(local_end)})
            strict.write(cfg, tmp_path / "tunnels.json")
            proc = _run(tmp_path, [sys.executable, "-c", "import time; time.sleep(300)"])
            try:
                assert wait_for(lambda: _works_unix(local_end), timeout=20)
                assert (local_end.parent.stat().st_mode & 0o777, local_end.stat().st_mode &
                        0o777) == (0o700, 0o600)
                assert [_other_user(local_end) for _ in range(9)] == \
                    ["refused: Permission denied"] * 9
                assert _works_unix(local_end)
                # folder and file opened to everyone by mistake: still closed, ssh unstarted
                local_end.parent.chmod(0o755)
                local_end.chmod(0o666)
                assert _other_user(local_end) == "closed"
                assert not _ssh_pids(proc.pid) and _works_unix(local_end)
            finally:
                proc.send_signal(signal.SIGTERM)
                out, _ = proc.communicate(timeout=30)
        assert f"tunnel to east up: {local_end} -> 127.0.0.1:" in out, out
        assert "tunnel to east: a connection of uid 65534 closed" in out, out
        assert not local_end.exists()  # the socket file goes with the tunnel
        assert "nebula-tunnel" not in keys.read_text()
    finally:
        shutil.rmtree(base)
