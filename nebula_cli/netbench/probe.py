"""The network probe that `nebula bench-network` runs on hosts: a server and a measurer.

    python -m nebula_cli.netbench.probe serve   --run RUN --certs DIR [--bind A] [--port P] ...
    python -m nebula_cli.netbench.probe measure --run RUN --certs DIR --host A --tls-port P ...
    python -m nebula_cli.netbench.probe stop    --run RUN

`serve` listens on a TLS port (mutual TLS with the run's certificates, as the relay does),
detaches (own session, stdio closed) and prints one JSON line ``{"pid", "tls_port"}``; it exits
by itself after ``--lifetime`` seconds. `measure` (`probe_client`) dials a server: round trips
of small frames (latency), then ``--streams`` connections sending frames for ``--duration``
seconds (throughput, counted by the server as it receives; with ``--reverse`` the server sends
and the measurer counts), over plain TCP and over TLS; prints one JSON line of figures. `stop`
ends this run's probes on the host (SIGTERM, then SIGKILL) and prints ``{"stopped", "left"}``.

Plain TCP is open only while a measurement needs it: over TLS, HELLO {op: plain, count} binds
the plain port (``--plain-port``, else ``--port`` + 1, else any) -> WELCOME {port, tickets}
(one-time tokens, one per
plain connection); a plain connection's first frame, at most PLAIN_HELLO_BYTES, must carry an
unused ticket, else it is closed. The plain port closes when that TLS connection ends.

Until a connection has authenticated (its TLS handshake and HELLO, or its ticket) it holds one
of MAX_PENDING slots of its port (the TLS port and each plain port have their own), at most
MAX_PENDING_PER_ADDRESS from one address (an IPv6 /64), for at most PENDING_DEADLINE seconds
and `admission.FIRST_BYTES_TIMEOUT` until its first byte; a new connection ends the oldest
silent pending one of its address, or of the address holding the most in the network holding
the most; one whose first bytes arrived only for a newcomer of a network holding at least two
fewer; when none can make room, the new one is closed (`nebula_cli.relay.net.admission`).
Frames are read with small caps (ECHO_PAYLOAD for echoed frames, none for control frames), on
plain TCP as on TLS.

On a connection: HELLO {op: echo|sink|source|report} -> WELCOME, then
- echo: HEARTBEAT frames are sent back as they are, until BYE.
- sink (meta token): PEER_CHUNK frames from the measurer; the server counts the bytes as it
  reads them, and when (its monotonic clock) the first and the last arrived. At the end of the
  duration the measurer resets the connection (SO_LINGER 0): what its buffers still held is
  dropped, so a test lasts its duration however slow the link and however large the buffers.
- source (meta seconds): once the measurer sends a HEARTBEAT (it reads from then on: nothing
  waits in buffers to be counted late), PEER_CHUNK frames to it for that long (at most
  MAX_DURATION), or until it resets the connection.
- report: STATE_REQUEST {tokens} -> RESULT {streams: [[bytes, first, last], ...]} once those
  sinks have ended (the control connection is not queued behind the data, as in iperf3).

Only the standard library, nebula_cli.pki and nebula_cli.relay.net (wire, admission): this runs
wherever the relay runs, without torch. DIR holds ca.pem, cert.pem and key.pem; RUN is the job
id in them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nebula_cli import pki
from nebula_cli.errors import NebulaError
from nebula_cli.netbench.measure import (
    CHUNK,
    ECHO_PAYLOAD,
    IO_TIMEOUT,
    MAX_DURATION,
    ROLES,
    ProbeError,
    _contexts,
    measure,
)
from nebula_cli.relay.net.admission import Admission, Pending, first_bytes
from nebula_cli.relay.net.wire import (
    ConnectionClosed,
    Frame,
    FrameType,
    WireError,
    recv_frame,
    recv_small_frame,
    send_frame,
    tune_socket,
)

MODULE = "nebula_cli.netbench.probe"
REPORT_WAIT = 10.0  # how long the server waits for the sinks of a report to end
PLAIN_HELLO_BYTES = 1024  # the most read from a plain connection before its ticket is checked
MAX_TICKETS = 256  # plain connections one measurement may ask for
MAX_PENDING = 32  # connections of one port before their HELLO (TLS) or ticket (plain)
MAX_PENDING_PER_ADDRESS = 4  # of those from one address (a measurer dials one at a time)
PENDING_DEADLINE = 10.0  # seconds from accept to HELLO or ticket

log = logging.getLogger("nebula.probe")


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
    ask = recv_frame(sock, max_payload=0)
    tokens = ask.meta.get("tokens")
    if ask.type != FrameType.STATE_REQUEST or not isinstance(tokens, list):
        raise WireError(f"expected STATE_REQUEST {{tokens}}, got {ask.type.name}")
    with _sinks_changed:
        _sinks_changed.wait_for(lambda: all(_sinks.get(t, [0] * 4)[3] for t in tokens),
                                timeout=REPORT_WAIT)
        streams = [_sinks.pop(t, [0, None, None])[:3] for t in tokens]
    send_frame(sock, Frame(FrameType.RESULT, {"streams": streams}))


def _source(sock: socket.socket, seconds: Any) -> None:
    """On the measurer's word (a HEARTBEAT, once it reads), send frames for `seconds`
    (bounded), or until the measurer resets the connection."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise WireError("source: expected the seconds to send")
    if recv_frame(sock, max_payload=0).type != FrameType.HEARTBEAT:
        raise WireError("source: expected the measurer's HEARTBEAT before sending")
    frame = Frame(FrameType.PEER_CHUNK, {}, os.urandom(CHUNK))
    end = time.monotonic() + min(float(seconds), MAX_DURATION)
    with contextlib.suppress(OSError, ConnectionClosed, WireError):  # the reset that ends it
        while time.monotonic() < end:
            send_frame(sock, frame)


def _echo(sock: socket.socket) -> None:
    while True:
        frame = recv_frame(sock, max_payload=ECHO_PAYLOAD)
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
        self.admission = _admission()
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
        self.admission.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed: the measurement is over
            _accept_loop(self.listener, self.admission, None, self.run, self)


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


def _admission() -> Admission:
    return Admission(MAX_PENDING, MAX_PENDING_PER_ADDRESS, PENDING_DEADLINE)


def _handle(sock: socket.socket, admission: Admission, entry: Pending,
            tls: ssl.SSLContext | None, run: str, plain: Plain | None = None,
            serve_args: Any = None) -> None:
    held = True
    try:
        if not first_bytes(sock):
            raise WireError("nothing arrived before the first-bytes deadline")
        admission.spoke(entry)
        sock.settimeout(IO_TIMEOUT)
        tune_socket(sock)
        if tls is not None:
            sock, _ = pki.wrap_server(sock, tls, job_id=run, roles=ROLES, timeout=IO_TIMEOUT)
            hello = recv_frame(sock, max_payload=0)
        else:
            hello = recv_small_frame(sock, PLAIN_HELLO_BYTES)  # no more before the ticket
            if plain is None or not plain.admit(hello.meta.get("ticket")):
                raise WireError("a plain connection without a valid ticket")
        admission.release(entry)
        held = False
        op, token = hello.meta.get("op"), hello.meta.get("token")
        if tls is not None and op == "plain" and serve_args is not None:
            _plain_session(sock, hello, serve_args.bind, serve_args.plain_port, run)
            return
        if hello.type != FrameType.HELLO or op not in ("echo", "sink", "source", "report") or (
                op == "sink" and not isinstance(token, str)):
            send_frame(sock, Frame(FrameType.ERROR, {
                "reason": "expected HELLO echo|sink|source|report"}))
            return
        send_frame(sock, Frame(FrameType.WELCOME, {"op": op}))
        if op == "sink":
            _sink(sock, token)
        elif op == "source":
            _source(sock, hello.meta.get("seconds"))
        else:
            (_echo if op == "echo" else _report)(sock)
    except ConnectionClosed:
        pass
    except (OSError, NebulaError) as exc:
        log.warning("connection %s from %s: %s", "tls" if tls else "plain", _addr(sock), exc)
    finally:
        if held:
            admission.release(entry)
        sock.close()


def _addr(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "<gone>"


def _accept_loop(listener: socket.socket, admission: Admission, tls: ssl.SSLContext | None,
                 run: str, plain: Plain | None = None, serve_args: Any = None) -> None:
    while True:
        sock, where = listener.accept()
        entry, ended = admission.admit(sock, str(where[0]))
        for old in ended:
            log.warning("ended a pending %s connection from %s: %d connections are not "
                        "authenticated yet (at most %d, %d per address)", "tls" if tls else
                        "plain", old.key, admission.held, MAX_PENDING, MAX_PENDING_PER_ADDRESS)
        if entry.ended is not None:
            log.warning("closed a new %s connection from %s: every pending one that could "
                        "make room has sent its first bytes", "tls" if tls else "plain",
                        entry.key)
            sock.close()
            continue
        threading.Thread(target=_handle, args=(sock, admission, entry, tls, run, plain,
                                               serve_args), daemon=True).start()


def _listen(bind: str, port: int) -> socket.socket:
    try:
        return socket.create_server((bind, port), backlog=64)
    except OSError as exc:
        raise ProbeError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}") from exc


def serve(args: argparse.Namespace) -> int:
    server_ctx, _ = _contexts(Path(args.certs))
    listener = _listen(args.bind, args.port)
    args.plain_port = args.plain_port or (args.port and args.port + 1)
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
    threading.Thread(target=_accept_loop, args=(listener, _admission(), server_ctx, args.run,
                                                None, args), daemon=True).start()
    time.sleep(args.lifetime)
    os._exit(0)


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
    s.add_argument("--plain-port", type=int, default=0, help="the plain port (0: as above)")
    s.add_argument("--lifetime", type=float, default=600.0, help="exit after this many s")
    s.add_argument("--log", default=None, help="append the server's log here")
    m.add_argument("--host", required=True)
    m.add_argument("--tls-port", type=int, required=True)
    m.add_argument("--peer-cluster", default=None, help="the cluster the server's cert names")
    m.add_argument("--duration", type=float, default=5.0)
    m.add_argument("--streams", type=int, default=4)
    m.add_argument("--pings", type=int, default=200)
    m.add_argument("--deadline", type=float, default=120.0, help="give up after this many s")
    m.add_argument("--reverse", action="store_true", help="the server sends, this counts")
    m.add_argument("--tls-socket", default=None,
                   help="dial this Unix socket file (a tunnel's local end), not the TLS port")
    m.add_argument("--plain-socket", default=None,
                   help="dial this Unix socket file (a tunnel's local end), not the plain port")
    m.add_argument("--wait", type=float, default=0.0,
                   help="retry refused connections this many s (a tunnel coming up)")
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
