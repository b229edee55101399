"""A tunnel key's authorized_keys line (`nebula_cli.agent.grants`) against a real stock sshd on
127.0.0.1: the key reaches its relay ports through the forced command (`agent.bridge`), and
nothing else: no shell, command, subsystem or pty; no forwarding of any kind (TCP or Unix
socket, local or remote, ``-W``); not after its expiry, which renewal pushes on."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.jobs import wait_for
from helpers.local_sshd import SSHD, LocalSshd, local_sshd
from helpers.sshd_bed import free_port

from nebula_cli.agent.grants import Grants, key_line
from nebula_cli.config import strict
from nebula_cli.config.tunnel_config import TUNNELS_FILE, TunnelConfig, TunnelGrant
from nebula_cli.control.renewal import extend_tunnel_keys
from nebula_cli.errors import NebulaError
from nebula_cli.pki import ssh_keypair
from nebula_cli.transport import LocalTransport

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SSHD),
                                reason="needs root and openssh-server for a test sshd")
TAG = "nebula-tunnel:job-g:lab>fort"


@contextlib.contextmanager
def echo_server() -> Iterator[int]:
    """A TCP server on 127.0.0.1 echoing each connection until its EOF (a relay's stand-in)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(4096):
                conn.sendall(data)

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = server.accept()
                conn.settimeout(10)
                threading.Thread(target=echo, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        server.close()


@dataclass
class Granted:
    sshd: LocalSshd
    key: Path
    grants: Grants
    ports: tuple[int, int]

    def ssh(self, *options: str, command: tuple[str, ...] = (), stdin: bytes = b""
            ) -> subprocess.CompletedProcess[bytes]:
        """ssh with the tunnel's key to the test sshd (`options`, the host, `command`)."""
        return subprocess.run([*self.argv(*options, "--"), "127.0.0.1", *command],
                              input=stdin, capture_output=True, timeout=20)

    def argv(self, *args: str) -> list[str]:
        return ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                "-o", f"IdentityFile={self.key}", "-o", "IdentityAgent=none",
                "-o", f"UserKnownHostsFile={self.sshd.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-p", str(self.sshd.port), "-l", "root",
                *args]


@pytest.fixture
def granted(tmp_path: Path) -> Iterator[Granted]:
    """The test sshd with a tunnel key granted as a relay grants it, for two echo ports."""
    with local_sshd(tmp_path, sftp=True) as sshd, echo_server() as a, echo_server() as b:
        private, public = ssh_keypair()
        key = tmp_path / "tunnel.key"
        key.write_bytes(private)
        key.chmod(0o600)
        grant = TunnelGrant(peer="lab", authorized_keys=str(tmp_path / "authorized_keys"),
                            public_key=public, targets=[f"127.0.0.1:{a}", f"127.0.0.1:{b}"],
                            expires=2**31 - 1, tag=TAG)
        cfg = TunnelConfig(job_id="job-g", cluster="fort", keepalive=1, keepalive_count=3,
                           grant_ttl=900, dial=[], grant=[grant])
        grants = Grants(cfg)
        grants.add()
        yield Granted(sshd, key, grants, (a, b))
        grants.revoke()


def test_the_key_reaches_its_ports_and_runs_nothing_else(granted: Granted) -> None:
    a, b = granted.ports
    first = granted.ssh("-T", stdin=b"ping")  # what a shell would be: the first port
    assert (first.returncode, first.stdout) == (0, b"ping"), first.stderr
    second = granted.ssh("-T", command=(f"127.0.0.1:{b}",), stdin=b"pong")  # the other one
    assert (second.returncode, second.stdout) == (0, b"pong"), second.stderr
    for command in ("id", "127.0.0.1:22", "sh -c 'nc -l 4000'"):
        got = granted.ssh("-T", command=(command,))
        assert got.returncode == 2 and got.stdout == b"", (command, got)
        assert b"is not a target this key may reach" in got.stderr, got.stderr
    sftp = granted.ssh("-T", "-s", command=("sftp",))  # a subsystem: the bridge instead
    assert sftp.returncode == 2 and sftp.stdout == b"", sftp
    pty = granted.ssh("-tt", stdin=b"")
    assert b"PTY allocation request failed" in pty.stderr, pty.stderr
    line = Path(granted.grants.cfg.grant[0].authorized_keys).read_text().splitlines()[-1]
    assert line.startswith('restrict,command="env PYTHONPATH=') and line.endswith(TAG)
    assert "port-forwarding" not in line and "permitopen" not in line


def test_the_key_may_forward_nothing(granted: Granted, tmp_path: Path) -> None:
    a, _ = granted.ports
    # -W: a direct-tcpip channel, what -L opens per connection (to the very port it may reach)
    stdio = granted.ssh("-N", "-W", f"127.0.0.1:{a}", stdin=b"ping")
    assert stdio.returncode == 255 and stdio.stdout == b"", stdio
    assert b"administratively prohibited" in stdio.stderr, stdio.stderr
    # -L: to a TCP port, to a Unix socket (direct-streamlocal); refused when used
    sock = tmp_path / "sshd-side.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))
    listener.listen()
    with listener:
        for target in (f"127.0.0.1:{a}", str(sock)):
            assert _local_forward(granted, target) == b"", target
    said = granted.sshd.log.read_text()
    assert "refused local port forward: originator 127.0.0.1 port" in said
    assert "refused streamlocal port forward: originator 127.0.0.1 port" in said
    # -R: a TCP port, a Unix socket (streamlocal-forward, which permitlisten does not cover)
    remote_sock = tmp_path / "made-by-key.sock"
    for spec in (f"127.0.0.1:0:127.0.0.1:{a}", f"{remote_sock}:127.0.0.1:{a}"):
        got = granted.ssh("-N", "-o", "ExitOnForwardFailure=yes", "-R", spec)
        assert got.returncode == 255, (spec, got)
        assert b"remote port forwarding failed" in got.stderr, got.stderr
    assert not remote_sock.exists()


def _local_forward(granted: Granted, target: str) -> bytes:
    """What a connection to `ssh -L PORT:target`'s local end reads (b"": closed at once, the
    channel refused)."""
    port = free_port()
    log = granted.key.with_name(f"forward-{port}.log")
    with log.open("wb") as err:
        proc = subprocess.Popen([*granted.argv("-N", "-L", f"127.0.0.1:{port}:{target}"),
                                 "127.0.0.1"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        conn = wait_for(lambda: _connect(port), timeout=15)
        with conn:
            conn.sendall(b"ping")
            try:
                got = conn.recv(100)
            except ConnectionResetError:
                got = b""
        wait_for(lambda: b"open failed" in log.read_bytes(), timeout=10)
        return got
    finally:
        proc.kill()
        proc.wait(10)


def _connect(port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=10)
    except ConnectionRefusedError:
        return None


def _expiry(granted: Granted) -> str:
    text = Path(granted.grants.cfg.grant[0].authorized_keys).read_text()
    found = re.search(r'expiry-time="(\d{14})Z"', text)
    assert found is not None, text
    return found.group(1)


def test_an_expired_key_is_refused_and_renewal_pushes_the_expiry_on(granted: Granted) -> None:
    grant = granted.grants.cfg.grant[0]
    keys = Path(grant.authorized_keys)
    stamp = _expiry(granted)  # grant_ttl (900 s) ahead
    ahead = time.mktime(time.strptime(stamp, "%Y%m%d%H%M%S")) - time.mktime(time.gmtime())
    assert 890 <= ahead <= 901, stamp
    # a line whose time has passed (a relay killed before it could take it back): refused
    old = key_line(grant, int(time.time()) - 60)
    keys.write_text(keys.read_text().replace(keys.read_text().splitlines()[-1], old))
    refused = granted.ssh("-T", stdin=b"ping")
    assert refused.returncode == 255 and b"Permission denied" in refused.stderr, refused
    assert wait_for(lambda: "Refused by key options" in granted.sshd.log.read_text(), timeout=10)
    # renewal: not before a third of grant_ttl has passed, then a line valid grant_ttl again
    assert not granted.grants.renew()
    granted.grants.renewed -= granted.grants.cfg.grant_ttl / 3
    assert granted.grants.renew() and _expiry(granted) >= stamp
    assert granted.ssh("-T", stdin=b"ping").stdout == b"ping"


def test_renewed_certificates_move_the_keys_cap_on(granted: Granted, tmp_path: Path) -> None:
    """A grant is capped at the certificates' end: once that passed, renewing the line cannot
    let the key in, unless the control plane's certificate renewal moved the cap on in the
    relay's tunnels.json (`control.renewal.extend_tunnel_keys`), which `renew` reads again."""
    cap = int(time.time()) + 3  # the certificates end in 3 s
    grant = dataclasses.replace(granted.grants.cfg.grant[0], expires=cap)
    cfg = dataclasses.replace(granted.grants.cfg, grant=[grant])
    strict.write(cfg, tmp_path / TUNNELS_FILE)
    grants = Grants(cfg, tmp_path / TUNNELS_FILE)
    grants.add()  # valid until the cap, not grant_ttl ahead
    assert granted.ssh("-T", stdin=b"ping").stdout == b"ping"
    wait_for(lambda: time.time() > cap + 1, timeout=10)
    refused = granted.ssh("-T", stdin=b"ping")
    assert refused.returncode == 255 and b"Permission denied" in refused.stderr, refused
    # the certificates renewed for a day: the relay's copy of tunnels.json says so
    until = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    local = LocalTransport("fort", home=str(tmp_path / "home"))
    assert extend_tunnel_keys(local, str(tmp_path), until)
    grants.renewed -= cfg.grant_ttl / 3  # its next renewal
    assert grants.renew()
    assert grants.cfg.grant[0].expires == int(until.timestamp())
    assert granted.ssh("-T", stdin=b"ping").stdout == b"ping"  # a dropped tunnel comes back
    # a tunnels.json that cannot be read: said (raised to `run`), the line renewed anyway
    (tmp_path / TUNNELS_FILE).write_text("{")
    grants.renewed -= cfg.grant_ttl / 3
    before = grants.renewed
    with pytest.raises(NebulaError):
        grants.renew()
    assert grants.renewed > before and grants.cfg.grant[0].expires == int(until.timestamp())
    grants.revoke()


def test_a_key_is_pinned_to_its_first_sessions_address(granted: Granted, tmp_path: Path) -> None:
    """A relay's grants (with the config's file) learn the address the key's first session came
    from, as sshd saw it, and write the line again with ``from=`` it: a session from another
    address (here 127.0.0.1 after 127.0.0.2) is refused; the next run learns anew."""
    folder = tmp_path / "relay"
    folder.mkdir(mode=0o700)
    strict.write(granted.grants.cfg, folder / TUNNELS_FILE)
    granted.grants.revoke()
    grants = Grants(granted.grants.cfg, folder / TUNNELS_FILE)
    grants.add()
    keys = Path(grants.cfg.grant[0].authorized_keys)
    seen = folder / "tunnels" / "lab.from"
    assert grants.pin() == [] and "from=" not in keys.read_text()
    assert f"--seen {seen} " in keys.read_text()
    # a session that asks for a target the key may not reach notes nothing
    assert granted.ssh("-T", "-o", "BindAddress=127.0.0.2", command=("id",)).returncode == 2
    assert not seen.exists()
    first = granted.ssh("-T", "-o", "BindAddress=127.0.0.2", stdin=b"ping")
    assert first.stdout == b"ping", first.stderr
    assert seen.read_text() == "127.0.0.2\n" and seen.stat().st_mode & 0o777 == 0o600
    assert grants.pin() == [(grants.cfg.grant[0], "127.0.0.2")]
    assert grants.pin() == []  # once
    assert 'from="127.0.0.2"' in keys.read_text()
    refused = granted.ssh("-T", "-o", "BindAddress=127.0.0.1", stdin=b"ping")
    assert refused.returncode == 255 and b"Permission denied" in refused.stderr, refused
    assert wait_for(lambda: "correct key but not from a permitted host (host=127.0.0.1, ip="
                    "127.0.0.1, required=127.0.0.2)" in granted.sshd.log.read_text(), timeout=10)
    assert granted.ssh("-T", "-o", "BindAddress=127.0.0.2", stdin=b"pong").stdout == b"pong"
    grants.renewed -= grants.cfg.grant_ttl / 3  # a renewal keeps the pin
    assert grants.renew() and 'from="127.0.0.2"' in keys.read_text()
    # the relay run again (a restart in the same folder): the old address is not kept
    again = Grants(granted.grants.cfg, folder / TUNNELS_FILE)
    again.add()
    assert not seen.exists() and "from=" not in keys.read_text()
    assert granted.ssh("-T", "-o", "BindAddress=127.0.0.1", stdin=b"ping").stdout == b"ping"
    assert again.pin() == [(grants.cfg.grant[0], "127.0.0.1")]
    again.revoke()
