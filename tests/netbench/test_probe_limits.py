"""bench-network's probe on a crowded port (nebula_cli.netbench.probe and measure, with
nebula_cli.relay.net.admission): a hostile client on eight addresses holds idle connections
on the probe's TLS port and on its plain port (reopening each one the probe ends), yet a real
measurement (a `probe measure` process) succeeds; frames that declare huge lengths, on the
plain port after a valid ticket or from a fake server to the measurer, are refused at their
header, at once, with nothing allocated.

REALWORLD rows: gateways reachable from the internet (the probe listens where the relay
will); links with 50-200 ms round trips (a slow legitimate handshake still gets in)."""

from __future__ import annotations

import contextlib
import datetime
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.crowd import Crowd
from helpers.sshd_bed import free_port

from nebula_cli import pki
from nebula_cli.errors import NebulaError
from nebula_cli.netbench import measure as probe_mod
from nebula_cli.relay.net.wire import (
    HEADER,
    MAGIC,
    WIRE_VERSION,
    Frame,
    FrameType,
    recv_small_frame,
    send_frame,
)

RUN = "netbench-crowd"


def certs_for(issued: pki.JobPKI, cluster: str, where: Path) -> Path:
    where.mkdir()
    pair = issued.relay(cluster)
    for name, src in (("ca.pem", issued.ca_cert), ("cert.pem", pair.cert),
                      ("key.pem", pair.key)):
        (where / name).write_bytes(src.read_bytes())
    return where


def probe(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nebula_cli.netbench.probe", *args],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A probe server on 127.0.0.1 (TLS port, plain port + 1) and the measurer's certs."""
    issued = pki.issue_job_pki(RUN, {"east": [], "west": []}, tmp_path / "pki",
                               valid_for=datetime.timedelta(days=1))
    west, east = certs_for(issued, "west", tmp_path / "west"), certs_for(
        issued, "east", tmp_path / "east")
    port = free_port()
    log = tmp_path / "serve.log"
    served = probe("serve", "--run", RUN, "--certs", str(west), "--bind", "0.0.0.0",
                   "--port", str(port), "--lifetime", "120", "--log", str(log))
    assert served.returncode == 0, served.stderr
    try:
        yield {"port": port, "east": east, "log": log, "issued": issued}
    finally:
        stopped = probe("stop", "--run", RUN)
        assert stopped.returncode == 0, stopped.stdout


def test_a_measurement_succeeds_while_a_crowd_holds_both_ports(server: dict[str, Any]) -> None:
    port = server["port"]
    with Crowd(("127.0.0.1", port), addresses=8, per_address=6) as tls_crowd, \
            Crowd(("127.0.0.1", port + 1), addresses=8, per_address=6) as plain_crowd:
        tls_crowd.wait_full()
        measured = probe("measure", "--run", RUN, "--certs", str(server["east"]),
                         "--host", "127.0.0.1", "--tls-port", str(port), "--peer-cluster",
                         "west", "--duration", "0.5", "--streams", "2", "--pings", "20")
        assert measured.returncode == 0, measured.stderr
        figures = json.loads(measured.stdout)
        assert figures["throughput_mbit"] > 0 and figures["plain_throughput_mbit"] > 0
        assert tls_crowd.ended > 0 and plain_crowd.opened > 0  # it was really crowded
    assert "ended a pending tls connection from 127.0.0." in server["log"].read_text()


def ended_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the other side ends `sock`, or None if it keeps it longer."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.monotonic() - t0


@pytest.mark.parametrize(("op", "frame_type", "declared", "cap"), [
    ("report", FrameType.STATE_REQUEST, 200 << 20, 0),
    ("echo", FrameType.HEARTBEAT, 8 << 20, probe_mod.ECHO_PAYLOAD),
])
def test_a_huge_length_on_the_plain_port_is_refused_at_its_header(
        server: dict[str, Any], op: str, frame_type: FrameType, declared: int,
        cap: int) -> None:
    """With a valid ticket (a measurement's own plain connection, or one whose ticket was
    read off the wire): a frame declaring megabytes ends the connection at once."""
    port = server["port"]
    ctx = pki.client_context(server["issued"].relay("east"), server["issued"].ca_cert)
    opened: dict[str, Any] = {}
    with probe_mod._dial(f"127.0.0.1:{port}", ctx, RUN, "west", opened, op="plain",
                         count=1) as control:
        sock = probe_mod._dial(f"127.0.0.1:{opened['port']}", None, RUN, None,
                               ticket=opened["tickets"][0], op=op)
        with sock:
            sock.sendall(HEADER.pack(MAGIC, WIRE_VERSION, int(frame_type), 0, 2, declared)
                         + b"{}" + bytes(1024))
            took = ended_within(sock, 5.0)
        send_frame(control, Frame(FrameType.BYE))
    assert took is not None and took < 2.0, took
    assert f"payload of {declared} bytes exceeds the cap of {cap}" in server["log"].read_text()


def test_the_measurer_refuses_a_huge_length_from_a_server_at_its_header() -> None:
    """A fake server on the plain port (anyone on the path of plain TCP) answers the HELLO with
    a WELCOME declaring 200 MiB: the measurer fails at once, nothing allocated or awaited."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[Frame] = []

    def fake() -> None:
        conn, _ = listener.accept()
        with conn:
            seen.append(recv_small_frame(conn, 1024))
            conn.sendall(HEADER.pack(MAGIC, WIRE_VERSION, int(FrameType.WELCOME), 0, 2,
                                     200 << 20) + b"{}")
            conn.settimeout(10)
            with contextlib.suppress(OSError):
                conn.recv(1)  # until the measurer hangs up

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(NebulaError, match="exceeds the cap of 0"):
            probe_mod._dial(f"127.0.0.1:{listener.getsockname()[1]}", None, RUN, None,
                            ticket="0" * 32, op="echo")
    finally:
        listener.close()
        thread.join(15)
    assert time.monotonic() - t0 < 2.0
    assert seen and seen[0].meta["op"] == "echo"
