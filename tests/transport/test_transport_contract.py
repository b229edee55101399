"""The Transport contract, run against both transports: LocalTransport, and SSHTransport against
a real sshd on 127.0.0.1 (helpers/sshd_bed.py's `bed`), with SFTP and without (hardened login
nodes: files then go over exec channels). Whatever differs between "a process here" and "a
process on that host" is a method of the interface, and this test holds both to it. The
OpenSSH back end (`transport: openssh`, the user's `ssh` over a master connection) is held to
it against the same sshd."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.sshd_bed import SSHD, Bed

from nebula_cli.transport import LocalTransport, Transport
from nebula_cli.transport.openssh.transport import OpenSSHTransport

SECRET = f"s3cret-{uuid.uuid4().hex}"


@pytest.fixture(params=["local", "ssh", "ssh-without-sftp", "openssh"])
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Transport]:
    if request.param == "local":
        t: Transport = LocalTransport("here", home=str(tmp_path / "home"))
    else:
        if os.geteuid() != 0 or not os.path.exists(SSHD):
            pytest.skip("needs root and openssh-server for a test sshd")
        bed = request.getfixturevalue("bed")
        if request.param == "openssh":
            yield from _openssh(bed)
            return
        t = bed.transport(port=bed.nosftp.port) if "without" in request.param \
            else bed.transport()
    with t:
        yield t


def _openssh(bed: Bed) -> Iterator[Transport]:  # noqa: F811 - the fixture's value
    """The user's `ssh` over a master connection (its socket in a short folder of /tmp: a
    socket path has at most 104 bytes); the master ended after."""
    control = tempfile.mkdtemp(prefix="nc-", dir="/tmp")
    t = OpenSSHTransport("target", "127.0.0.1", user="root", port=bed.target.port,
                         key=str(bed.user_key), known_hosts=str(bed.known_hosts),
                         ssh_config=str(bed.no_config), connect_timeout=5.0,
                         control_dir=control)
    try:
        with t:
            yield t
    finally:
        t.exit_master()
        shutil.rmtree(control, ignore_errors=True)


def _remote_dir(t: Transport) -> str:
    return f"{t.home}/contract-{uuid.uuid4().hex[:8]}"


def _cmdlines() -> list[bytes]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            found.append(entry.joinpath("cmdline").read_bytes())
        except OSError:
            continue
    return found


def test_environment_values_never_reach_a_command_line(transport: Transport) -> None:
    seen: list[bool] = []
    result_box: list[object] = []

    def run() -> None:
        result_box.append(transport.run(
            ["sh", "-c", 'sleep 1; printf "%s|%s|" "$TOKEN" "$MULTI"; cat'],
            env={"TOKEN": SECRET, "MULTI": "a\nb\\c $HOME"}, cwd="/tmp", stdin=b"input"))

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 0.9
    while thread.is_alive() and time.monotonic() < deadline:
        seen.append(any(SECRET.encode() in line for line in _cmdlines()))
        time.sleep(0.05)
    thread.join(30)
    assert seen and not any(seen), "the secret was visible in a command line"
    result = result_box[0]
    assert result.ok and result.stdout == f"{SECRET}|a\nb\\c $HOME|input"  # type: ignore[attr-defined]


def test_files_round_trip_with_modes(transport: Transport, tmp_path: Path) -> None:
    base = _remote_dir(transport)
    transport.makedirs(f"{base}/a/b", mode=0o700)
    transport.put_bytes(b"secret key", f"{base}/a/b/key", mode=0o600)
    assert transport.exists(f"{base}/a/b/key") and not transport.exists(f"{base}/nope")
    assert transport.read_file(f"{base}/a/b/key") == b"secret key"
    assert transport.read_tail(f"{base}/a/b/key", 7) == (b"key", 10)
    assert transport.read_file(f"{base}/missing") is None
    mode = transport.run(["stat", "-c", "%a", f"{base}/a/b/key"]).stdout.strip()
    assert mode == "600"
    transport.get(f"{base}/a/b/key", str(tmp_path / "back"))
    assert (tmp_path / "back").read_bytes() == b"secret key"
    transport.run(["rm", "-rf", base])


def test_upload_tree_copies_changes_only_and_honours_excludes(transport: Transport,
                                                              tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "pkg" / "__pycache__" / "mod.pyc").write_bytes(b"\0")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    remote = _remote_dir(transport)
    progress: list[tuple[int, int]] = []
    files, size = transport.upload_tree(str(src), remote, ["__pycache__"],
                                        lambda d, t: progress.append((d, t)))
    assert (files, size) == (2, len("x = 1\n") + len("#!/bin/sh\n"))
    assert progress and progress[-1] == (size, size)
    assert transport.read_file(f"{remote}/pkg/mod.py") == b"x = 1\n"
    assert not transport.exists(f"{remote}/pkg/__pycache__")
    mode = transport.run(["stat", "-c", "%a", f"{remote}/run.sh"]).stdout.strip()
    assert mode == "755"
    assert transport.upload_tree(str(src), remote, ["__pycache__"]) == (0, 0)  # unchanged
    time.sleep(1.1)  # a new whole-second mtime
    (src / "pkg" / "mod.py").write_text("x = 2\n")
    assert transport.upload_tree(str(src), remote, ["__pycache__"])[0] == 1
    assert transport.read_file(f"{remote}/pkg/mod.py") == b"x = 2\n"
    transport.run(["rm", "-rf", remote])


def test_a_service_on_the_host_is_reached_at_its_address(transport: Transport) -> None:
    port = transport.listen_port()
    serve = ("import socket,sys; s=socket.socket(); "
             "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
             f"s.bind(({transport.bind_address!r}, {port})); s.listen(1); s.settimeout(20); "
             "c, _ = s.accept(); c.sendall(b'hello from the host'); c.close()")
    box: list[object] = []
    server = threading.Thread(target=lambda: box.append(transport.run(
        [transport.python, "-c", serve],
        timeout=30)))
    server.start()
    deadline = time.monotonic() + 20
    data = b""
    while time.monotonic() < deadline and not data:
        try:
            with socket.create_connection((transport.address, port), timeout=2) as sock:
                data = sock.recv(64)
        except OSError:
            time.sleep(0.1)
    server.join(30)
    assert data == b"hello from the host", box


def test_shared_files_mean_nothing_to_upload(transport: Transport, tmp_path: Path) -> None:
    assert os.path.isabs(transport.home)
    (tmp_path / "f").write_text("here")
    if transport.shares_files:
        assert transport.read_file(str(tmp_path / "f")) == b"here"
        assert transport.upload_tree(str(tmp_path), str(tmp_path)) == (0, 0)
        port = transport.listen_port(29400)  # hosts sharing this machine get a free port
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
    else:
        assert transport.listen_port(29400) == 29400  # a fixed port a firewall can allow


def test_route_interface_names_the_interface_that_reaches_an_address(
        transport: Transport) -> None:
    from nebula_cli.transport.routes import ROUTE_PY, parse_route

    assert transport.route_interface("127.0.0.1") == "lo"  # a peer on this machine
    python = transport.run([transport.python, "-c", "import sys; print(sys.executable)"]
                           ).stdout.strip()
    bare = transport.run([python, "-c", ROUTE_PY, "127.0.0.1"],
                         env={"PATH": "/nonexistent"})  # no iproute2: the kernel's source
    assert '"source": "127.0.0.1"' in bare.stdout
    assert parse_route(bare.stdout, transport.name, "127.0.0.1") == "lo"


def test_route_output_without_an_interface_is_an_error_naming_the_host() -> None:
    from nebula_cli.errors import TransportError
    from nebula_cli.transport.routes import parse_route

    with pytest.raises(TransportError, match="cannot tell which interface reaches 10.9.8.7: "
                       "no route to 10.9.8.7") as err:
        parse_route('{"interface": null, "error": "no route to 10.9.8.7"}\n', "gpu3", "10.9.8.7")
    assert "gpu3" in str(err.value) and "interface:" in str(err.value)
    assert parse_route('{"interface": "ens5", "source": "10.0.0.2"}', "gpu3", "10.0.0.9") == "ens5"
