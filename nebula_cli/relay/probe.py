"""The network probe that `nebula bench-network` runs on hosts: a server and a measurer.

    python -m nebula_cli.relay.probe serve   --run RUN --certs DIR [--bind A] [--port P] ...
    python -m nebula_cli.relay.probe measure --run RUN --certs DIR --host A --tls-port P ...
    python -m nebula_cli.relay.probe stop    --run RUN

`serve` listens on a TLS port (mutual TLS with the run's certificates, as the relay does),
detaches (own session, stdio closed) and prints one JSON line ``{"pid", "tls_port"}``; it exits
by itself after ``--lifetime`` seconds. `measure` dials a server: round trips of small frames
(latency), then ``--streams`` connections sending frames for ``--duration`` seconds
(throughput, counted by the server as it receives), over plain TCP and over TLS; prints one
JSON line of figures. `stop` ends this run's probes on the host (SIGTERM, then SIGKILL) and
prints ``{"stopped", "left"}``.

Plain TCP is open only while a measurement needs it: over TLS, HELLO {op: plain, count} binds
the plain port (``--port`` + 1, or any) -> WELCOME {port, tickets} (one-time tokens, one per
plain connection); a plain connection's first frame, at most PLAIN_HELLO_BYTES, must carry an
unused ticket, else it is closed. The plain port closes when that TLS connection ends.

On a connection: HELLO {op: echo|sink|report} -> WELCOME, then
- echo: HEARTBEAT frames are sent back as they are, until BYE.
- sink (meta token): PEER_CHUNK frames from the measurer; the server counts the bytes as it
  reads them, and when (its monotonic clock) the first and the last arrived. At the end of the
  duration the measurer resets the connection (SO_LINGER 0): what its buffers still held is
  dropped, so a test lasts its duration however slow the link and however large the buffers.
- report: STATE_REQUEST {tokens} -> RESULT {streams: [[bytes, first, last], ...]} once those
  sinks have ended (the control connection is not queued behind the data, as in iperf3).

Only the standard library, nebula_cli.pki and nebula_cli.relay.wire: this runs wherever the
relay runs, without torch. DIR holds ca.pem, cert.pem and key.pem; RUN is the job id in them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import secrets
import signal
import socket
import ssl
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nebula_cli import pki
from nebula_cli.errors import NebulaError
from nebula_cli.relay.wire import (
    ConnectionClosed,
    Frame,
    FrameType,
    WireError,
    recv_frame,
    recv_small_frame,
    send_frame,
    tune_socket,
)

MODULE = "nebula_cli.relay.probe"
ROLES = {"relay", "worker"}
SOCKET_BUFFER = 4 << 20  # as the relay sets its sockets (relay.client.tune_buffers)
CHUNK = 256 * 1024  # payload bytes per frame in throughput tests
PING_BYTES = 64
WARMUP_PINGS = 5
IO_TIMEOUT = 30.0  # any single socket operation
REPORT_WAIT = 10.0  # how long the server waits for the sinks of a report to end
MAX_DURATION = 600.0
MAX_PAYLOAD = 16 << 20
PLAIN_HELLO_BYTES = 1024  # the most read from a plain connection before its ticket is checked
MAX_TICKETS = 256  # plain connections one measurement may ask for
MAX_UNAUTHENTICATED = 16  # plain connections before their ticket, and TLS ones before HELLO

log = logging.getLogger("nebula.probe")


class ProbeError(NebulaError):
    """A measurement could not be made."""


# ------------------------------------------------------------------------------- sockets


def _tune(sock: socket.socket) -> None:
    tune_socket(sock)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)


def _contexts(certs: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    pair = pki.CertPair(certs / "cert.pem", certs / "key.pem")
    return pki.server_context(pair, certs / "ca.pem"), pki.client_context(pair, certs / "ca.pem")


# -------------------------------------------------------------------------------- server


_sinks: dict[str, list[Any]] = {}  # token -> [bytes, first, last, ended]
_sinks_changed = threading.Condition()


def _sink(sock: socket.socket, token: str) -> None:
    """Count what arrives (into one reused buffer) until the measurer resets or closes."""
    stats: list[Any] = [0, None, None, False]
    with _sinks_changed:
        _sinks[token] = stats
    buf = memoryview(bytearray(CHUNK))
    try:
        while n := sock.recv_into(buf):
            now = time.monotonic()
            stats[0] += n
            stats[1] = stats[1] or now
            stats[2] = now
    except OSError:  # ssl.SSLError too
        pass  # the reset that ends the test
    finally:
        with _sinks_changed:
            stats[3] = True
            _sinks_changed.notify_all()


def _report(sock: socket.socket) -> None:
    sock.settimeout(MAX_DURATION + IO_TIMEOUT)  # idle while the streams send
    ask = recv_frame(sock)
    tokens = ask.meta.get("tokens")
    if ask.type != FrameType.STATE_REQUEST or not isinstance(tokens, list):
        raise WireError(f"expected STATE_REQUEST {{tokens}}, got {ask.type.name}")
    with _sinks_changed:
        _sinks_changed.wait_for(lambda: all(_sinks.get(t, [0] * 4)[3] for t in tokens),
                                timeout=REPORT_WAIT)
        streams = [_sinks.pop(t, [0, None, None])[:3] for t in tokens]
    send_frame(sock, Frame(FrameType.RESULT, {"streams": streams}))


def _echo(sock: socket.socket) -> None:
    while True:
        frame = recv_frame(sock, max_payload=MAX_PAYLOAD)
        if frame.type == FrameType.BYE:
            return
        send_frame(sock, frame)


class Plain:
    """The plain TCP port of one measurement: bound on request, closed when it is over; a
    connection is served only with one of the one-time tickets handed out over TLS."""

    def __init__(self, bind: str, port: int, count: int, run: str) -> None:
        self.listener = _listen(bind, port)
        self.port = self.listener.getsockname()[1]
        self.tickets = {secrets.token_hex(16) for _ in range(count)}
        self.run = run
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def admit(self, ticket: Any) -> bool:
        with self.lock:
            if isinstance(ticket, str) and ticket in self.tickets:
                self.tickets.discard(ticket)
                return True
            return False

    def close(self) -> None:
        with self.lock:
            self.tickets.clear()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed: the measurement is over
            _accept_loop(self.listener, None, self.run, self)


def _plain_session(sock: ssl.SSLSocket, hello: Frame, bind: str, port: int, run: str) -> None:
    """Open the plain port for one measurement; close it when this TLS connection ends."""
    count = hello.meta.get("count")
    if not isinstance(count, int) or not 1 <= count <= MAX_TICKETS:
        send_frame(sock, Frame(FrameType.ERROR, {"reason": f"count must be 1..{MAX_TICKETS}"}))
        return
    plain = Plain(bind, port, count, run)
    try:
        send_frame(sock, Frame(FrameType.WELCOME, {"op": "plain", "port": plain.port,
                                                   "tickets": sorted(plain.tickets)}))
        sock.settimeout(MAX_DURATION + IO_TIMEOUT)
        with contextlib.suppress(OSError, NebulaError):
            recv_frame(sock, max_payload=0)  # BYE, or the connection ends
    finally:
        plain.close()


_unauthenticated = threading.BoundedSemaphore(MAX_UNAUTHENTICATED)


def _handle(sock: socket.socket, tls: ssl.SSLContext | None, run: str,
            plain: Plain | None = None, serve_args: Any = None) -> None:
    held = True
    try:
        sock.settimeout(IO_TIMEOUT)
        _tune(sock)
        if tls is not None:
            sock, _ = pki.wrap_server(sock, tls, job_id=run, roles=ROLES, timeout=IO_TIMEOUT)
            hello = recv_frame(sock, max_payload=0)
        else:
            hello = recv_small_frame(sock, PLAIN_HELLO_BYTES)  # no more before the ticket
            if plain is None or not plain.admit(hello.meta.get("ticket")):
                raise WireError("a plain connection without a valid ticket")
        _unauthenticated.release()
        held = False
        op, token = hello.meta.get("op"), hello.meta.get("token")
        if tls is not None and op == "plain" and serve_args is not None:
            _plain_session(sock, hello, serve_args.bind, serve_args.plain_port, run)
            return
        if hello.type != FrameType.HELLO or op not in ("echo", "sink", "report") or (
                op == "sink" and not isinstance(token, str)):
            send_frame(sock, Frame(FrameType.ERROR, {"reason": "expected HELLO echo|sink|report"}))
            return
        send_frame(sock, Frame(FrameType.WELCOME, {"op": op}))
        if op == "sink":
            _sink(sock, token)
        else:
            (_echo if op == "echo" else _report)(sock)
    except ConnectionClosed:
        pass
    except (OSError, NebulaError) as exc:
        log.warning("connection %s from %s: %s", "tls" if tls else "plain", _addr(sock), exc)
    finally:
        if held:
            _unauthenticated.release()
        sock.close()


def _addr(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "<gone>"


def _accept_loop(listener: socket.socket, tls: ssl.SSLContext | None, run: str,
                 plain: Plain | None = None, serve_args: Any = None) -> None:
    while True:
        sock, where = listener.accept()
        if not _unauthenticated.acquire(blocking=False):
            log.warning("refused a %s connection from %s:%s: %d connections are not "
                        "authenticated yet", "tls" if tls else "plain", where[0], where[1],
                        MAX_UNAUTHENTICATED)
            sock.close()
            continue
        threading.Thread(target=_handle, args=(sock, tls, run, plain, serve_args),
                         daemon=True).start()


def _listen(bind: str, port: int) -> socket.socket:
    try:
        return socket.create_server((bind, port), backlog=64)
    except OSError as exc:
        raise ProbeError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}") from exc


def serve(args: argparse.Namespace) -> int:
    server_ctx, _ = _contexts(Path(args.certs))
    listener = _listen(args.bind, args.port)
    args.plain_port = args.port and args.port + 1
    pid = os.fork()
    if pid:  # the parent reports and leaves; the child serves on, detached
        print(json.dumps({"pid": pid, "tls_port": listener.getsockname()[1]}), flush=True)
        os._exit(0)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    out = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if args.log else null
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    threading.Thread(target=_accept_loop, args=(listener, server_ctx, args.run, None, args),
                     daemon=True).start()
    time.sleep(args.lifetime)
    os._exit(0)


# ------------------------------------------------------------------------------- measure


def _dial(host: str, port: int, tls: ssl.SSLContext | None, run: str, cluster: str | None,
          welcome: dict[str, Any] | None = None, **hello: Any) -> socket.socket:
    """Connect, send HELLO ``hello``, expect WELCOME (its meta into ``welcome``)."""
    try:
        sock = socket.create_connection((host, port), timeout=IO_TIMEOUT)
    except OSError as exc:
        raise ProbeError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
    _tune(sock)
    if tls is not None:
        sock, _ = pki.wrap_client(sock, tls, job_id=run, roles=ROLES, cluster=cluster,
                                  timeout=IO_TIMEOUT)
    send_frame(sock, Frame(FrameType.HELLO, hello))
    answer = recv_frame(sock)
    if answer.type != FrameType.WELCOME:
        sock.close()
        raise ProbeError(f"{host}:{port} answered {answer.type.name} {answer.meta}")
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
        echo = recv_frame(sock)
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


def throughput(dial: Callable[..., socket.socket], streams: int,
               duration: float) -> dict[str, float]:
    """`streams` connections each sending frames for `duration` s; Mbit/s as the server
    received them (all streams: bytes / from the first arrival to the last)."""
    tokens = [os.urandom(8).hex() for _ in range(streams)]
    with dial(op="report") as control:
        socks: list[socket.socket] = []
        try:
            for token in tokens:
                socks.append(dial(op="sink", token=token))
            stop = threading.Event()
            errors: list[BaseException] = []
            frame = Frame(FrameType.PEER_CHUNK, {}, os.urandom(CHUNK))

            def send(sock: socket.socket) -> None:
                try:
                    while not stop.is_set():
                        send_frame(sock, frame)
                except (OSError, NebulaError) as exc:
                    if not stop.is_set():
                        errors.append(exc)

            threads = [threading.Thread(target=send, args=(s,), daemon=True) for s in socks]
            for t in threads:
                t.start()
            stop.wait(duration)
            stop.set()
            for sock in socks:
                _abort(sock)
            for t in threads:
                t.join(IO_TIMEOUT)
        finally:
            for sock in socks:
                sock.close()
        if errors:
            raise ProbeError(f"{len(errors)} of {streams} streams failed: {errors[0]}")
        send_frame(control, Frame(FrameType.STATE_REQUEST, {"tokens": tokens}))
        answer = recv_frame(control)
    if answer.type != FrameType.RESULT or len(answer.meta.get("streams", ())) != streams:
        raise ProbeError(f"expected RESULT of {streams} streams, got {answer.type.name}")
    got = [s for s in answer.meta["streams"] if s[0]]
    total = sum(s[0] for s in got)
    seconds = max((s[2] for s in got), default=0) - min((s[1] for s in got), default=0)
    if total <= 0 or seconds <= 0:
        raise ProbeError("the server received nothing")
    return {"mbit": total * 8 / seconds / 1e6, "bytes": total, "seconds": seconds}


def measure(args: argparse.Namespace) -> int:
    signal.alarm(max(math.ceil(args.deadline), 1))  # never outlive the caller's wait
    _, client_ctx = _contexts(Path(args.certs))

    def tls(**hello: Any) -> socket.socket:
        return _dial(args.host, args.tls_port, client_ctx, args.run, args.peer_cluster, **hello)

    # the plain port opens for this measurement only: one ticket per plain connection
    opened: dict[str, Any] = {}
    with _dial(args.host, args.tls_port, client_ctx, args.run, args.peer_cluster, opened,
               op="plain", count=2 + args.streams) as control:
        tickets = iter(opened.get("tickets", []))

        def plain(**hello: Any) -> socket.socket:
            return _dial(args.host, int(opened["port"]), None, args.run, None,
                         ticket=next(tickets, ""), **hello)

        ways: dict[str, Callable[..., socket.socket]] = {"plain": plain, "tls": tls}
        rtt, tput, cipher = {}, {}, None
        for way, dial in ways.items():  # round trips first, on an idle link
            with dial(op="echo") as sock:
                if isinstance(sock, ssl.SSLSocket):
                    cipher = (sock.cipher() or ("?",))[0]
                rtt[way] = ping(sock, args.pings)
        tput["plain"] = throughput(plain, args.streams, args.duration)
        with contextlib.suppress(OSError, NebulaError):
            send_frame(control, Frame(FrameType.BYE))
    tput["tls"] = throughput(tls, args.streams, args.duration)
    print(json.dumps({
        "rtt_ms": rtt["tls"]["median"], "rtt_p95_ms": rtt["tls"]["p95"],
        "plain_rtt_ms": rtt["plain"]["median"], "plain_rtt_p95_ms": rtt["plain"]["p95"],
        "throughput_mbit": tput["tls"]["mbit"], "plain_throughput_mbit": tput["plain"]["mbit"],
        "bytes": tput["tls"]["bytes"], "plain_bytes": tput["plain"]["bytes"], "cipher": cipher,
    }), flush=True)
    return 0


# ---------------------------------------------------------------------------------- stop


def probe_pids(run: str) -> list[int]:
    """Pids of this run's servers and measurers on this host: their argv is this module, serve
    or measure, and the run id. Zombies have an empty cmdline and so do not count."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = entry.joinpath("cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if MODULE.encode() in argv and run.encode() in argv:
            i = argv.index(MODULE.encode())
            if argv[i + 1 : i + 2] in ([b"serve"], [b"measure"]):
                found.append(int(entry.name))
    return found


def stop(args: argparse.Namespace) -> int:
    """SIGTERM this run's probes, SIGKILL what is left after a grace, check they are gone."""
    pids = set(probe_pids(args.run))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in probe_pids(args.run):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 3.0
        while probe_pids(args.run) and time.monotonic() < deadline:
            time.sleep(0.05)
    left = probe_pids(args.run)
    print(json.dumps({"stopped": sorted(pids - set(left)), "left": left}), flush=True)
    return 0 if not left else 1


# ---------------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="listen (TLS and plain TCP), detach, print pid and ports")
    m = sub.add_parser("measure", help="latency and throughput to a server; one JSON line")
    k = sub.add_parser("stop", help="end this run's probes on this host")
    for q in (s, m, k):
        q.add_argument("--run", required=True, help="the run id (the job id in the certificates)")
    for q in (s, m):
        q.add_argument("--certs", required=True, help="directory of ca.pem, cert.pem, key.pem")
    s.add_argument("--bind", default="0.0.0.0")
    s.add_argument("--port", type=int, default=0,
                   help="TLS port; plain, while a measurement needs it, is port+1 (0: any)")
    s.add_argument("--lifetime", type=float, default=600.0, help="exit after this many s")
    s.add_argument("--log", default=None, help="append the server's log here")
    m.add_argument("--host", required=True)
    m.add_argument("--tls-port", type=int, required=True)
    m.add_argument("--peer-cluster", default=None, help="the cluster the server's cert names")
    m.add_argument("--duration", type=float, default=5.0)
    m.add_argument("--streams", type=int, default=4)
    m.add_argument("--pings", type=int, default=200)
    m.add_argument("--deadline", type=float, default=120.0, help="give up after this many s")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return {"serve": serve, "measure": measure, "stop": stop}[args.command](args)
    except (OSError, NebulaError) as exc:
        print(f"probe {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
