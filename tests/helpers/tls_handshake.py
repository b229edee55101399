"""One real mutual-TLS handshake over 127.0.0.1 with nebula's wrap_server / wrap_client, for
the PKI tests; a real client's first flight (its ClientHello), for the admission tests."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading

from nebula_cli.pki import wrap_client, wrap_server

TIMEOUT = 5.0


def handshake(
    server_ctx: ssl.SSLContext,
    client_ctx: ssl.SSLContext,
    *,
    server_roles: set[str],
    client_roles: set[str] = frozenset({"relay"}),
    server_cluster: str | None = None,
    job_id: str,
    server_timeout: float = TIMEOUT,
    client_sends: bool = True,
) -> dict[str, object]:
    """One real handshake over 127.0.0.1. Returns what each side got: a tuple or an exception.

    On success the client sends b"ping" and the server answers b"pong", so data really flows.
    """
    out: dict[str, object] = {}
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT)
    port = listener.getsockname()[1]

    def serve() -> None:
        conn = None
        try:
            conn, _ = listener.accept()
            sslsock, ident = wrap_server(
                conn,
                server_ctx,
                job_id=job_id,
                roles=server_roles,
                cluster=server_cluster,
                timeout=server_timeout,
            )
            with sslsock:
                sslsock.settimeout(TIMEOUT)
                data = sslsock.recv(4)
                sslsock.sendall(b"pong")
                out["server"] = (ident, sslsock.version(), data)
        except Exception as exc:  # recorded for the test to inspect
            out["server"] = exc
        finally:
            if conn is not None:
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    try:
        if client_sends:
            sslsock, ident = wrap_client(
                sock, client_ctx, job_id=job_id, roles=client_roles, timeout=TIMEOUT
            )
            with sslsock:
                try:
                    sslsock.sendall(b"ping")
                    reply = sslsock.recv(4)
                except OSError as exc:
                    reply = exc
                out["client"] = (ident, sslsock.version(), reply)
        else:  # a silent client: connected, never says anything
            thread.join(TIMEOUT)
    except Exception as exc:
        out["client"] = exc
    finally:
        sock.close()
        thread.join(TIMEOUT)
        listener.close()
    assert not thread.is_alive(), "server thread did not finish"
    return out



def client_hello(server_name: str | None) -> bytes:
    """The first flight of a real TLS client (Python's ssl), with `server_name` as its SNI."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    out = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), out, server_hostname=server_name)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()

