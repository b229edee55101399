"""The measuring side of bench-network's probe (`python -m nebula_cli.netbench.probe measure`), and
what both sides share: the run's TLS contexts, socket tuning, frame sizes.

`measure` dials a server: round trips of small frames (latency), then ``--streams`` connections
for ``--duration`` seconds (throughput), over plain TCP and over TLS. The measurer sends and the
server counts (``sink``), or with ``--reverse`` the server sends and the measurer counts
(``source``): both directions of a link are measured over connections one side dials, as a
relay's link is. Through an SSH tunnel, ``--tls-socket`` and ``--plain-socket`` name the
tunnel's local ends (Unix socket files of this user's, `agent.tunnel`) dialled instead of the
server's ports; ``--wait`` retries refused connections that long (a tunnel still coming up).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import signal
import socket
import ssl
import statistics
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nebula_cli import pki
from nebula_cli.agent import unix_socket
from nebula_cli.errors import NebulaError
from nebula_cli.relay.net.wire import Frame, FrameType, recv_frame, send_frame, tune_socket

ROLES = {"relay", "worker"}
CHUNK = 256 * 1024  # payload bytes per frame in throughput tests
PING_BYTES = 64
ECHO_PAYLOAD = 4096  # the largest echoed frame either side reads (pings are PING_BYTES)
WARMUP_PINGS = 5
IO_TIMEOUT = 30.0  # any single socket operation
MAX_DURATION = 600.0


class ProbeError(NebulaError):
    """A measurement could not be made."""


# ------------------------------------------------------------------------------- sockets


def _contexts(certs: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    pair = pki.CertPair(certs / "cert.pem", certs / "key.pem")
    return pki.server_context(pair, certs / "ca.pem"), pki.client_context(pair, certs / "ca.pem")


# ------------------------------------------------------------------------------- measure


def _connect(where: str, wait: float) -> socket.socket:
    """A connection to "host:port" over TCP, or to the Unix socket file at the absolute path
    `where` (a tunnel's local end, served by this user's process); refusals retried for `wait`
    seconds."""
    deadline = time.monotonic() + wait
    while True:
        try:
            if os.path.isabs(where):
                return _connect_unix(where)
            host, _, port = where.rpartition(":")
            return socket.create_connection((host.strip("[]"), int(port)), timeout=IO_TIMEOUT)
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            if time.monotonic() >= deadline:
                raise ProbeError(f"cannot connect to {where}: {exc.strerror}") from exc
            time.sleep(0.2)
        except OSError as exc:
            raise ProbeError(f"cannot connect to {where}: {exc.strerror or exc}") from exc


def _connect_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(IO_TIMEOUT)
        with unix_socket.bindable(path) as name:
            sock.connect(name)
        if (uid := unix_socket.peer_uid(sock)) != os.getuid():
            raise PermissionError(errno.EPERM, f"served by uid {uid}, not by this user")
    except BaseException:
        sock.close()
        raise
    return sock


def _dial(where: str, tls: ssl.SSLContext | None, run: str, cluster: str | None,
          welcome: dict[str, Any] | None = None, wait: float = 0.0,
          **hello: Any) -> socket.socket:
    """Connect to `where` (see `_connect`), send HELLO ``hello``, expect WELCOME (its meta into
    ``welcome``)."""
    sock = _connect(where, wait)
    if sock.family != socket.AF_UNIX:
        tune_socket(sock)
    if tls is not None:
        sock, _ = pki.wrap_client(sock, tls, job_id=run, roles=ROLES, cluster=cluster,
                                  timeout=IO_TIMEOUT)
    send_frame(sock, Frame(FrameType.HELLO, hello))
    answer = recv_frame(sock, max_payload=0)  # WELCOME and ERROR carry meta only
    if answer.type != FrameType.WELCOME:
        sock.close()
        raise ProbeError(f"{where} answered {answer.type.name} {answer.meta}")
    if welcome is not None:
        welcome.update(answer.meta)
    return sock


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100) of non-empty values."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def ping(sock: socket.socket, count: int) -> dict[str, float]:
    """Round trips of PING_BYTES-byte frames: median and p95 in ms (after a short warm-up)."""
    frame = Frame(FrameType.HEARTBEAT, {}, os.urandom(PING_BYTES))
    rtts = []
    for i in range(WARMUP_PINGS + count):
        t0 = time.perf_counter()
        send_frame(sock, frame)
        echo = recv_frame(sock, max_payload=ECHO_PAYLOAD)
        if i >= WARMUP_PINGS:
            rtts.append((time.perf_counter() - t0) * 1e3)
        if echo.type != FrameType.HEARTBEAT or bytes(echo.payload) != frame.payload:
            raise ProbeError("the echo differs from the frame sent")
    send_frame(sock, Frame(FrameType.BYE))
    return {"median": statistics.median(rtts), "p95": percentile(rtts, 95)}


def _abort(sock: socket.socket) -> None:
    """Reset the connection now: unsent data is dropped, a blocked sender wakes up."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the TCP socket under TLS as well


def _dial_all(dial: Callable[..., socket.socket], hellos: list[dict[str, Any]]
              ) -> list[socket.socket]:
    """One connection per HELLO; if one cannot be opened, those already open are closed."""
    socks: list[socket.socket] = []
    try:
        for hello in hellos:
            socks.append(dial(**hello))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def _run_streams(socks: list[socket.socket], work: Callable[..., None], args: list[tuple[Any, ...]],
                 duration: float, start: Callable[[socket.socket], None] | None = None) -> None:
    """Run `work(stop, errors, *a)` in a thread per stream for `duration` s, then reset the
    streams and close them (also on failure); ProbeError if any stream failed meanwhile."""
    stop = threading.Event()
    errors: list[BaseException] = []
    threads = [threading.Thread(target=work, args=(stop, errors, *a), daemon=True) for a in args]
    try:
        for sock, t in zip(socks, threads, strict=True):
            if start is not None:
                start(sock)
            t.start()
        stop.wait(duration)
    finally:
        stop.set()
        for sock in socks:
            _abort(sock)
        for t in threads:
            if t.ident is not None:  # started
                t.join(IO_TIMEOUT)
        for sock in socks:
            sock.close()
    if errors:
        raise ProbeError(f"{len(errors)} of {len(socks)} streams failed: {errors[0]}")


def _rate(spans: list[Any], nothing: str) -> dict[str, float]:
    """Mbit/s of streams given as [bytes, first arrival, last arrival]: all their bytes over
    the time from the first arrival to the last."""
    got = [s for s in spans if s[0]]
    total = sum(s[0] for s in got)
    seconds = max((s[2] for s in got), default=0) - min((s[1] for s in got), default=0)
    if total <= 0 or seconds <= 0:
        raise ProbeError(nothing)
    return {"mbit": total * 8 / seconds / 1e6, "bytes": total, "seconds": seconds}


def throughput(dial: Callable[..., socket.socket], streams: int,
               duration: float) -> dict[str, float]:
    """`streams` connections each sending frames for `duration` s; Mbit/s as the server
    received them (all streams: bytes / from the first arrival to the last)."""
    tokens = [os.urandom(8).hex() for _ in range(streams)]
    frame = Frame(FrameType.PEER_CHUNK, {}, os.urandom(CHUNK))

    def send(stop: threading.Event, errors: list[BaseException], sock: socket.socket) -> None:
        try:
            while not stop.is_set():
                send_frame(sock, frame)
        except (OSError, NebulaError) as exc:
            if not stop.is_set():
                errors.append(exc)

    with dial(op="report") as control:
        socks = _dial_all(dial, [{"op": "sink", "token": token} for token in tokens])
        _run_streams(socks, send, [(s,) for s in socks], duration)
        send_frame(control, Frame(FrameType.STATE_REQUEST, {"tokens": tokens}))
        answer = recv_frame(control, max_payload=0)
    if answer.type != FrameType.RESULT or len(answer.meta.get("streams", ())) != streams:
        raise ProbeError(f"expected RESULT of {streams} streams, got {answer.type.name}")
    return _rate(answer.meta["streams"], "the server received nothing")


def throughput_from(dial: Callable[..., socket.socket], streams: int,
                    duration: float) -> dict[str, float]:
    """`streams` connections on which the server sends frames for `duration` s; Mbit/s as
    received here (all streams: bytes / from the first arrival to the last)."""
    socks = _dial_all(dial, [{"op": "source", "seconds": duration + IO_TIMEOUT}] * streams)
    stats: list[list[Any]] = [[0, None, None] for _ in socks]

    def receive(stop: threading.Event, errors: list[BaseException], sock: socket.socket,
                counts: list[Any]) -> None:
        buf = memoryview(bytearray(CHUNK))
        try:
            while not stop.is_set() and (n := sock.recv_into(buf)):
                now = time.monotonic()
                counts[0] += n
                counts[1] = counts[1] or now
                counts[2] = now
        except OSError as exc:  # ssl.SSLError too
            if not stop.is_set():
                errors.append(exc)

    def go(sock: socket.socket) -> None:  # the server sends once told
        send_frame(sock, Frame(FrameType.HEARTBEAT, {"op": "go"}))

    _run_streams(socks, receive, list(zip(socks, stats, strict=True)), duration, start=go)
    return _rate(stats, "nothing was received from the server")


def measure(args: argparse.Namespace) -> int:
    signal.alarm(max(math.ceil(args.deadline), 1))  # never outlive the caller's wait
    _, client_ctx = _contexts(Path(args.certs))

    server = f"[{args.host}]" if ":" in args.host else args.host
    tls_end = args.tls_socket or f"{server}:{args.tls_port}"

    def tls(**hello: Any) -> socket.socket:
        return _dial(tls_end, client_ctx, args.run, args.peer_cluster, wait=args.wait, **hello)

    rate = throughput_from if args.reverse else throughput

    # the plain port opens for this measurement only: one ticket per plain connection
    opened: dict[str, Any] = {}
    with _dial(tls_end, client_ctx, args.run, args.peer_cluster, opened, wait=args.wait,
               op="plain", count=2 + args.streams) as control:
        tickets = iter(opened.get("tickets", []))
        plain_end = args.plain_socket or f"{server}:{int(opened['port'])}"

        def plain(**hello: Any) -> socket.socket:
            return _dial(plain_end, None, args.run, None, wait=args.wait,
                         ticket=next(tickets, ""), **hello)

        ways: dict[str, Callable[..., socket.socket]] = {"plain": plain, "tls": tls}
        rtt, tput, cipher = {}, {}, None
        for way, dial in ways.items():  # round trips first, on an idle link
            with dial(op="echo") as sock:
                if isinstance(sock, ssl.SSLSocket):
                    cipher = (sock.cipher() or ("?",))[0]
                rtt[way] = ping(sock, args.pings)
        tput["plain"] = rate(plain, args.streams, args.duration)
        with contextlib.suppress(OSError, NebulaError):
            send_frame(control, Frame(FrameType.BYE))
    tput["tls"] = rate(tls, args.streams, args.duration)
    print(json.dumps({
        "rtt_ms": rtt["tls"]["median"], "rtt_p95_ms": rtt["tls"]["p95"],
        "plain_rtt_ms": rtt["plain"]["median"], "plain_rtt_p95_ms": rtt["plain"]["p95"],
        "throughput_mbit": tput["tls"]["mbit"], "plain_throughput_mbit": tput["plain"]["mbit"],
        "bytes": tput["tls"]["bytes"], "plain_bytes": tput["plain"]["bytes"], "cipher": cipher,
    }), flush=True)
    return 0


