"""Certificates renewed while a job runs (nebula_cli.pki.certs.extend_job_pki, tls.
reload_if_renewed): short-lived certificates, real TLS 1.3 handshakes over loopback. A relay
whose files were renewed and one whose files were not yet accept each other both ways; after
the first certificates expire, a process with only the old files is refused and one that got
the new files (its context reloads them before its next handshake, nothing restarted) gets
through; a connection made before the expiry carries data after it."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from helpers.tls_handshake import handshake

from nebula_cli.pki import (
    CertPair,
    PeerRejected,
    client_context,
    extend_job_pki,
    issue_job_pki,
    renewal_due,
    server_context,
    wrap_client,
    wrap_server,
)
from nebula_cli.pki.certs import expiry

JOB = "job-20260101-000000-live"
CLUSTERS = {"east": ["e1"], "west": ["w1"]}
SHORT = dt.timedelta(seconds=8)


def _on_host(pair: CertPair, ca: Path, where: Path) -> tuple[CertPair, Path]:
    """The files as an agent's certs/ holds them (replaced atomically, as a launch writes)."""
    where.mkdir(parents=True, exist_ok=True)
    held = CertPair(where / "relay.pem", where / "relay.key")
    for src, dst in ((pair.key, held.key), (pair.cert, held.cert), (ca, where / "ca.pem")):
        tmp = dst.with_name(dst.name + ".new")
        shutil.copy(src, tmp)
        os.replace(tmp, dst)
    return held, where / "ca.pem"


def _ok(result: dict[str, object]) -> bool:
    return isinstance(result.get("server"), tuple) and isinstance(result.get("client"), tuple)


def _connect(server_ctx: object, client_ctx: object) -> tuple[object, object]:
    """An established mutual-TLS connection (server side, client side)."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: dict[str, object] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        got["server"] = wrap_server(conn, server_ctx, job_id=JOB, roles={"relay"})[0]

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sock = socket.create_connection(listener.getsockname(), timeout=5)
    client = wrap_client(sock, client_ctx, job_id=JOB, roles={"relay"})[0]
    thread.join(5)
    listener.close()
    return got["server"], client


def test_renewed_while_running_without_a_restart(tmp_path: Path) -> None:
    pki = issue_job_pki(JOB, CLUSTERS, tmp_path / "pki", valid_for=SHORT)
    first_expiry = expiry(pki.root)
    east, east_ca = _on_host(pki.relay("east"), pki.ca_cert, tmp_path / "east")
    west, west_ca = _on_host(pki.relay("west"), pki.ca_cert, tmp_path / "west")
    east_server, west_client = server_context(east, east_ca), client_context(west, west_ca)
    west_server, east_client = server_context(west, west_ca), client_context(east, east_ca)
    assert _ok(handshake(east_server, west_client, server_roles={"relay"}, job_id=JOB))
    kept_server, kept_client = _connect(east_server, west_client)
    assert renewal_due(pki.root)  # a third of its period or less is left

    extend_job_pki(pki.root, valid_for=dt.timedelta(hours=1))
    assert expiry(pki.root) > first_expiry + dt.timedelta(minutes=50)
    _on_host(pki.relay("east"), pki.ca_cert, tmp_path / "east")  # east got its new files
    # east (renewed, reloaded) and west (its files not renewed yet) accept each other
    assert _ok(handshake(east_server, west_client, server_roles={"relay"}, job_id=JOB))
    assert _ok(handshake(west_server, east_client, server_roles={"relay"}, job_id=JOB))

    left = (first_expiry - dt.datetime.now(dt.UTC)).total_seconds()
    time.sleep(max(0.0, left) + 1.5)  # the first certificates have expired
    stale = handshake(east_server, west_client, server_roles={"relay"}, job_id=JOB)
    assert isinstance(stale.get("server"), PeerRejected) or isinstance(
        stale.get("client"), PeerRejected)  # west still presents its expired certificate
    _on_host(pki.relay("west"), pki.ca_cert, tmp_path / "west")  # west's files renewed
    assert _ok(handshake(east_server, west_client, server_roles={"relay"}, job_id=JOB))
    assert _ok(handshake(west_server, east_client, server_roles={"relay"}, job_id=JOB))

    kept_client.sendall(b"still")  # the connection made before the expiry carries on
    assert kept_server.recv(5) == b"still"
    kept_client.close()
    kept_server.close()


def test_renewal_is_due_in_the_last_third_of_the_period(tmp_path: Path) -> None:
    pki = issue_job_pki(JOB, CLUSTERS, tmp_path / "pki", valid_for=dt.timedelta(days=90))
    now = dt.datetime.now(dt.UTC)
    assert not renewal_due(pki.root, now)
    assert not renewal_due(pki.root, now + dt.timedelta(days=55))
    assert renewal_due(pki.root, now + dt.timedelta(days=61))
