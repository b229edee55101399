"""Mutual-TLS contexts and peer checks on the job's certificates.

TLS 1.3 only, certificates required both ways; ``ssl`` checks the chain to the job's CA,
:func:`check_peer` checks the job id, role and cluster from the SAN after the handshake (no
hostname checks: relays are reached by address, identity lives in the certificate).

A context remembers its files: before each handshake (`_wrap`) it loads them again if they were
renewed meanwhile (`reload_if_renewed`), so a month-long job's relays and workers take renewed
certificates (`certs.extend_job_pki`) without a restart.
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from nebula_cli.errors import NebulaError
from nebula_cli.pki.certs import (
    ROLES,
    CertPair,
    Identity,
    PeerRejected,
    identity_of,
    log,
)

HANDSHAKE_TIMEOUT = 30.0
"""Default bound (seconds) on a TLS handshake in :func:`wrap_server` / :func:`wrap_client`."""

# OpenSSL X509_V_ERR_* codes that mean "not signed by the CA we trust".
_FOREIGN_CHAIN_CODES = {2, 18, 19, 20, 21}
_EXPIRED = 10
_NOT_YET_VALID = 9


# --------------------------------------------------------------------------- TLS contexts


def _context(protocol: int, pair: CertPair, ca: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # identity is the SAN URI, checked by check_peer
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(certfile=str(pair.cert), keyfile=str(pair.key))
        ctx.load_verify_locations(cafile=str(ca))
    except FileNotFoundError as exc:
        raise NebulaError(f"TLS file missing: {exc.filename}") from exc
    except (ssl.SSLError, OSError) as exc:
        raise NebulaError(f"cannot load TLS files {pair.cert}, {pair.key}, {ca}: {exc}") from exc
    _LOADED[ctx] = (pair, Path(ca), _stamp(pair, Path(ca)))
    return ctx


_LOADED: weakref.WeakKeyDictionary[ssl.SSLContext, tuple[CertPair, Path, tuple[int, ...]]] = (
    weakref.WeakKeyDictionary())
"""Each context made here: its files and their modification times when loaded."""
_RELOAD_LOCK = threading.Lock()


def _stamp(pair: CertPair, ca: Path) -> tuple[int, ...]:
    try:
        return tuple(os.stat(p).st_mtime_ns for p in (pair.cert, pair.key, ca))
    except OSError:
        return ()


def reload_if_renewed(ctx: ssl.SSLContext) -> bool:
    """Load a context's certificate, key and CA again when their files changed since it loaded
    them (a running job's certificates renewed: `certs.extend_job_pki`); the next handshake
    uses them, established connections keep theirs. A pair caught half replaced (a key that
    does not match its certificate yet) is left for the next call. Whether it reloaded."""
    entry = _LOADED.get(ctx)
    if entry is None:
        return False
    pair, ca, stamp = entry
    now = _stamp(pair, ca)
    if not now or now == stamp:
        return False
    with _RELOAD_LOCK:
        try:
            ctx.load_cert_chain(certfile=str(pair.cert), keyfile=str(pair.key))
            ctx.load_verify_locations(cafile=str(ca))  # the CA certified again, added
        except (ssl.SSLError, OSError) as exc:
            log.info("renewed TLS files not loaded yet (%s); the next handshake tries again",
                     exc)
            return False
        _LOADED[ctx] = (pair, ca, now)
    log.info("loaded renewed TLS files %s", pair.cert)
    return True


def server_context(pair: CertPair, ca: Path) -> ssl.SSLContext:
    """Server side: TLS 1.3 only, a client certificate chained to ``ca`` is required."""
    return _context(ssl.PROTOCOL_TLS_SERVER, pair, ca)


def client_context(pair: CertPair, ca: Path) -> ssl.SSLContext:
    """Client side: TLS 1.3 only, presents ``pair``, requires a server cert chained to ``ca``."""
    return _context(ssl.PROTOCOL_TLS_CLIENT, pair, ca)


# --------------------------------------------------------------------------- peer checks


def admission_name(ca: Path) -> str:
    """The server name (SNI) a job's relays send in their ClientHello, for which their peer
    ports keep slots that other clients of a shared address cannot take
    (`nebula_cli.relay.net.admission`): drawn from the job CA's public key, which only the
    job's hosts hold (in their private folders); the same for every relay of the job (a renewal
    keeps the CA's key; a resume draws a new CA, and with it a new name). It is sent in clear:
    it tells peers apart, it authenticates nobody."""
    key = x509.load_pem_x509_certificate(ca.read_bytes()).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(b"nebula peer admission\0" + key).hexdigest()[:32] + ".nebula"


def _peer_addr(sock: socket.socket) -> str:
    try:
        addr = sock.getpeername()
    except OSError:
        return "<unknown>"
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = f"[{addr[0]}]" if ":" in str(addr[0]) else str(addr[0])
        return f"{host}:{addr[1]}"
    return str(addr) or "<local>"


def _reject(reason: str, peer: str) -> PeerRejected:
    log.warning("rejected TLS peer %s: %s", peer, reason)
    return PeerRejected(reason, peer=peer)


def peer_identity(sslsock: ssl.SSLSocket) -> Identity:
    """The identity of the peer of a handshaken socket (from its certificate's SAN URI)."""
    der = sslsock.getpeercert(binary_form=True)
    if not der:
        raise PeerRejected("peer presented no certificate", peer=_peer_addr(sslsock))
    try:
        return identity_of(x509.load_der_x509_certificate(der))
    except PeerRejected as exc:
        raise PeerRejected(exc.reason, peer=_peer_addr(sslsock)) from None


def _a(role: str) -> str:
    return f"a {role}"


def check_peer(
    sslsock: ssl.SSLSocket,
    *,
    job_id: str,
    roles: Iterable[str],
    cluster: str | None = None,
) -> Identity:
    """Check that the peer belongs to ``job_id``, has one of ``roles`` (and ``cluster``, if given).

    The chain to the job's CA is already checked by ``ssl``. Raises :class:`PeerRejected` (and logs
    a warning naming the reason and the peer address) on any mismatch.
    """
    wanted = set(roles)
    if not wanted or not wanted <= ROLES:
        raise ValueError(f"roles must be a non-empty subset of {sorted(ROLES)}, got {roles!r}")
    peer = _peer_addr(sslsock)
    try:
        ident = peer_identity(sslsock)
    except PeerRejected as exc:
        raise _reject(exc.reason, peer) from None
    if ident.job_id != job_id:
        raise _reject(f"certificate of job {ident.job_id}, expected {job_id}", peer)
    if ident.role not in wanted:
        need = " or ".join(_a(r) for r in sorted(wanted))
        raise _reject(f"{ident.role} certificate presented where {need} is required", peer)
    if cluster is not None and ident.cluster != cluster:
        raise _reject(f"certificate of cluster {ident.cluster}, expected {cluster}", peer)
    return ident


def _handshake_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        detail = exc.verify_message or str(exc)
        if code == _EXPIRED:
            return f"certificate has expired ({detail})"
        if code == _NOT_YET_VALID:
            return f"certificate is not yet valid ({detail})"
        if code in _FOREIGN_CHAIN_CODES:
            return f"certificate not issued by this job's CA ({detail})"
        return f"certificate verification failed ({detail})"
    if isinstance(exc, ssl.SSLError):
        why = exc.reason or str(exc)
        if why == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return "peer presented no certificate"
        if why == "NO_PROTOCOLS_AVAILABLE" or "VERSION" in str(why):
            return f"TLS version refused, TLS 1.3 is required ({why})"
        if "ALERT_UNKNOWN_CA" in str(why):
            return f"peer does not trust our certificate: not issued by its job's CA ({why})"
        if "ALERT_CERTIFICATE_EXPIRED" in str(why):
            return f"peer says our certificate has expired ({why})"
        if "ALERT" in str(why):
            return f"peer aborted the handshake ({why})"
        return f"TLS handshake failed ({why})"
    if isinstance(exc, TimeoutError):
        return "TLS handshake timed out"
    return f"connection lost during TLS handshake ({exc})"


def _wrap(
    sock: socket.socket,
    ctx: ssl.SSLContext,
    *,
    server_side: bool,
    job_id: str,
    roles: Iterable[str],
    cluster: str | None,
    timeout: float | None,
    server_name: str | None = None,
) -> tuple[ssl.SSLSocket, Identity]:
    peer = _peer_addr(sock)
    reload_if_renewed(ctx)
    previous = sock.gettimeout()
    sslsock: ssl.SSLSocket | None = None
    try:
        sock.settimeout(timeout)
        sslsock = ctx.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False,
                                  server_hostname=server_name)
        sslsock.do_handshake()
        ident = check_peer(sslsock, job_id=job_id, roles=roles, cluster=cluster)
        sslsock.settimeout(previous)
        return sslsock, ident
    except PeerRejected:
        (sslsock or sock).close()
        raise
    except OSError as exc:  # ssl.SSLError, TimeoutError, resets
        (sslsock or sock).close()
        raise _reject(_handshake_reason(exc), peer) from exc
    except BaseException:
        (sslsock or sock).close()
        raise


def wrap_server(
    sock: socket.socket,
    ctx: ssl.SSLContext,
    *,
    job_id: str,
    roles: Iterable[str],
    cluster: str | None = None,
    timeout: float | None = HANDSHAKE_TIMEOUT,
) -> tuple[ssl.SSLSocket, Identity]:
    """Server side of an accepted connection: TLS handshake, then :func:`check_peer`.

    On refusal the socket is closed and :class:`PeerRejected` is raised (reason + peer address).
    ``timeout`` bounds the handshake; the socket's own timeout is restored afterwards.
    """
    return _wrap(
        sock, ctx, server_side=True, job_id=job_id, roles=roles, cluster=cluster, timeout=timeout
    )


def wrap_client(
    sock: socket.socket,
    ctx: ssl.SSLContext,
    *,
    job_id: str,
    roles: Iterable[str],
    cluster: str | None = None,
    timeout: float | None = HANDSHAKE_TIMEOUT,
    server_name: str | None = None,
) -> tuple[ssl.SSLSocket, Identity]:
    """Client side of a connected socket: TLS handshake, then :func:`check_peer` on the server.
    ``server_name``: sent as the ClientHello's SNI (the job's admission name; not checked
    against the certificate, whose identity is its SAN URI).

    With TLS 1.3 a server that refuses *our* certificate may only be noticed on the first read.
    """
    return _wrap(
        sock, ctx, server_side=False, job_id=job_id, roles=roles, cluster=cluster,
        timeout=timeout, server_name=server_name,
    )
