"""The wire format on real sockets: TCP tuning, idle timeouts, mutual TLS, and a small server
that closes a bad connection and serves the good one. Helpers: helpers/wire_frames.py."""

from __future__ import annotations

import datetime as dt
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from helpers.wire_frames import header, raw, socket_pair

from nebula_cli.relay.net.wire import (
    ConnectionClosed,
    Frame,
    FrameType,
    IdleTimeout,
    WireError,
    close_after_refusal,
    encode_frame,
    recv_frame,
    send_frame,
    tune_socket,
)

# ---------------------------------------------------------------------------- timeouts, TLS


def test_tuned_sockets_keep_the_kernels_buffer_autotuning() -> None:
    """Relay, client and probe sockets go through tune_socket: NODELAY on, buffer sizes left to
    TCP's autotuning (a fixed SO_RCVBUF would cap a long fat WAN link's window on stock hosts):
    a tuned socket's buffers are an untuned one's, and a slow reader's receive buffer grows
    during a bulk transfer. How fast it grows is the kernel's heuristic (bytes the reader copies
    per round trip), which CPU load on a 2-core machine can hold back for one 64 MiB transfer
    (seen once in a full run): up to three transfers are made, and growth in any one shows the
    buffer is not locked."""
    srv = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(srv.getsockname(), timeout=10)
    receiver, _ = srv.accept()
    plain = socket.create_connection(srv.getsockname(), timeout=10)
    plain_peer, _ = srv.accept()
    srv.close()
    try:
        for sock in (sender, receiver):
            tune_socket(sock)
        assert sender.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            assert receiver.getsockopt(socket.SOL_SOCKET, opt) == \
                plain_peer.getsockopt(socket.SOL_SOCKET, opt)
        start = receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        total = 64 << 20

        def send() -> None:
            with suppress(OSError):  # the reader may stop after the first transfer
                for _ in range(3):
                    sender.sendall(bytes(total))

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        receiver.settimeout(10)
        grown = False
        for _ in range(3):
            got = 0
            while got < total and (chunk := receiver.recv(min(1 << 16, total - got))):
                got += len(chunk)
                time.sleep(0.0005)  # a reader slower than the writer: the window must grow
            assert got == total
            grown = receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) > start
            if grown:
                break
        assert grown
    finally:
        for sock in (sender, receiver, plain, plain_peer):
            sock.close()


def test_idle_timeout_leaves_the_stream_usable_but_a_stall_mid_frame_does_not() -> None:
    with socket_pair(timeout=0.1) as (a, b):
        with pytest.raises(IdleTimeout):
            recv_frame(b)
        send_frame(a, Frame(FrameType.HEARTBEAT, {"n": 1}))
        assert recv_frame(b) == Frame(FrameType.HEARTBEAT, {"n": 1})
        a.sendall(raw(Frame(FrameType.CONTRIB, {}, b"xyz"))[:-1])
        with pytest.raises(WireError, match="timed out after 2 of 3 bytes of the payload") as info:
            recv_frame(b)
        assert not isinstance(info.value, IdleTimeout)


def _tls_contexts(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A throwaway self-signed certificate used by both ends (mutual TLS 1.3)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nebula wire test")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    contexts = []
    for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(cert_path, key_path)
        ctx.load_verify_locations(cert_path)
        contexts.append(ctx)
    return contexts[0], contexts[1]


@contextmanager
def tls_pair(tmp_path: Path) -> Iterator[tuple[ssl.SSLSocket, ssl.SSLSocket]]:
    server_ctx, client_ctx = _tls_contexts(tmp_path)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    accepted: list[ssl.SSLSocket] = []

    def accept() -> None:
        conn, _ = listener.accept()
        conn.settimeout(10)
        accepted.append(server_ctx.wrap_socket(conn, server_side=True))

    thread = threading.Thread(target=accept)
    thread.start()
    client = client_ctx.wrap_socket(socket.create_connection(listener.getsockname(), timeout=10))
    thread.join(10)
    try:
        assert accepted, "TLS accept did not complete"
        yield accepted[0], client
    finally:
        client.close()
        for s in accepted:
            s.close()
        listener.close()


def test_frames_round_trip_over_mutual_tls(tmp_path: Path) -> None:
    big = bytes(range(256)) * (6 * 4096 + 7)  # ~6 MiB: many TLS records, partial recv_into
    fs = [
        Frame(FrameType.HELLO, {"cluster": "a", "émoji": "✓"}),
        Frame(FrameType.STATE, {"chunk": 0}, big),
        Frame(FrameType.BYE),
    ]
    with tls_pair(tmp_path) as (server, client):
        sender = threading.Thread(target=lambda: [send_frame(client, f) for f in fs])
        sender.start()
        got = [recv_frame(server, max_payload=len(big)) for _ in fs]
        sender.join(10)
        assert got == fs
        client.sendall(raw(Frame(FrameType.CONTRIB, {}, b"0123456789"))[:-4])
        client.shutdown(socket.SHUT_WR)  # EOF without close_notify, mid-frame
        with pytest.raises(WireError, match="truncated frame"):
            recv_frame(server)


# ---------------------------------------------------------------------------- a small server


class EchoServer:
    """Answers HELLO with WELCOME and CONTRIB with RESULT (same meta and payload) until BYE;
    a connection that breaks the wire format gets an ERROR frame and is closed, logged."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.address = self.listener.getsockname()
        self.threads: list[threading.Thread] = []
        self.completed: list[str] = []

    def serve(self, connections: int) -> None:
        for _ in range(connections):
            conn, peer = self.listener.accept()
            t = threading.Thread(target=self.handle, args=(conn, f"{peer[0]}:{peer[1]}"))
            t.start()
            self.threads.append(t)

    def handle(self, conn: socket.socket, peer: str) -> None:
        conn.settimeout(10)
        with conn:
            try:
                while True:
                    frame = recv_frame(conn, max_payload=1 << 20)
                    if frame.type is FrameType.HELLO:
                        send_frame(conn, Frame(FrameType.WELCOME, {"hello": frame.meta["name"]}))
                    elif frame.type is FrameType.CONTRIB:
                        send_frame(conn, Frame(FrameType.RESULT, frame.meta, frame.payload))
                    elif frame.type is FrameType.BYE:
                        self.completed.append(frame.meta["name"])
                        return
            except ConnectionClosed:
                self.log.info("%s went away", peer)
            except WireError as exc:
                self.log.warning("closing connection from %s: %s", peer, exc)
                with suppress(WireError):
                    send_frame(conn, Frame(FrameType.ERROR, {"reason": str(exc)}))

    def close(self) -> None:
        for t in self.threads:
            t.join(10)
        self.listener.close()


@pytest.mark.parametrize(
    ("garbage", "reason"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"),
        (header(FrameType.CONTRIB, 0, 2**40), "exceeds the cap"),
        (header(FrameType.CONTRIB, 5) + b"{1:2}", "not valid JSON"),
    ],
)
def test_server_closes_the_bad_connection_and_serves_the_good_one(
    garbage: bytes, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    log = logging.getLogger("nebula.test.wire")
    caplog.set_level(logging.INFO, logger=log.name)
    server = EchoServer(log)
    acceptor = threading.Thread(target=server.serve, args=(2,))
    acceptor.start()
    bad = socket.create_connection(server.address, timeout=10)
    good = socket.create_connection(server.address, timeout=10)
    try:
        bad.sendall(garbage[:7])  # the bad peer's thread is now mid-header, blocked
        send_frame(good, Frame(FrameType.HELLO, {"name": "good"}))
        assert recv_frame(good) == Frame(FrameType.WELCOME, {"hello": "good"})
        bad.sendall(garbage[7:])
        error = recv_frame(bad)
        assert error.type is FrameType.ERROR and reason in error.meta["reason"]
        with suppress(ConnectionResetError):  # a reset when it left bytes of ours unread
            assert bad.recv(1) == b""  # closed by the server
        payload = bytes(range(256)) * 2048  # 512 KiB echoed back after the bad one is gone
        send_frame(good, Frame(FrameType.CONTRIB, {"round": 1}, payload))
        echoed = recv_frame(good)
        assert echoed == Frame(FrameType.RESULT, {"round": 1}, payload)
        send_frame(good, Frame(FrameType.BYE, {"name": "good"}))
        acceptor.join(10)
    finally:
        bad.close()
        good.close()
        server.close()
    assert server.completed == ["good"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "closing connection from 127.0.0.1:" in warnings[0]
    assert reason in warnings[0]


def test_the_payload_cap_is_the_one_in_force_when_the_frame_arrives() -> None:
    """A peer link waits in recv_frame with the cap of the moment; the relay's workers may
    register the sync size (raising the cap) while it waits. A chunk that arrives afterwards
    is measured against the new cap (it used to kill the link: a round then diverged)."""
    import threading

    a, b = socket.socketpair()
    cap = [64]
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(recv_frame(a, max_payload=lambda: cap[0])))
    try:
        reader.start()
        time.sleep(0.2)  # the reader is waiting, with the small cap
        cap[0] = 1 << 20
        b.sendall(b"".join(encode_frame(Frame(FrameType.PEER_CHUNK, {"k": 0}, bytes(75_272)))))
        reader.join(10)
        assert isinstance(got[0], Frame) and len(got[0].payload) == 75_272
    finally:
        a.close()
        b.close()


def test_a_refused_connection_reads_away_what_its_peer_still_sends_within_bounds() -> None:
    """close_after_refusal: the peer reads the refusal and then the end; one that keeps
    sending is read for at most ``most`` bytes or ``seconds``, then closed (real TCP)."""
    import threading

    def pair() -> tuple[socket.socket, socket.socket]:
        with socket.create_server(("127.0.0.1", 0)) as srv:
            peer = socket.create_connection(srv.getsockname())
            mine, _ = srv.accept()
        return mine, peer

    mine, peer = pair()
    try:
        peer.sendall(b"x" * 1000)  # unread when the refusal goes out
        send_frame(mine, Frame(FrameType.ERROR, {"reason": "no"}))
        closer = threading.Thread(target=close_after_refusal, args=(mine,))
        closer.start()
        peer.sendall(b"y" * 100_000)  # still sending: no reset
        peer.settimeout(5)
        assert recv_frame(peer).meta == {"reason": "no"}
        assert peer.recv(1) == b""  # this side ended after its refusal
        peer.close()
        closer.join(5)
        assert not closer.is_alive() and mine.fileno() == -1
    finally:
        peer.close()
        mine.close()

    for bound in ({"most": 256 * 1024, "seconds": 30.0}, {"most": 1 << 40, "seconds": 0.5}):
        mine, peer = pair()
        stop = threading.Event()

        def flood(peer: socket.socket, stop: threading.Event) -> None:
            with suppress(OSError):
                while not stop.is_set():
                    peer.sendall(b"z" * 65536)

        t = threading.Thread(target=flood, args=(peer, stop))
        try:
            t.start()
            t0 = time.monotonic()
            close_after_refusal(mine, **bound)  # type: ignore[arg-type]
            assert time.monotonic() - t0 < 10, bound
            assert mine.fileno() == -1
        finally:
            stop.set()
            peer.close()
            t.join(10)
            mine.close()
