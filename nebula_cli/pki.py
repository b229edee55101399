"""Per-job certificate authority and the mutual-TLS contexts built on it.

Every job gets its own CA. Each cluster relay and each worker host gets a certificate
signed by it whose SAN URI ``nebula://<job_id>/<role>/<cluster>/<name>`` says who it is
(``name`` is ``relay`` for relays, the host name for workers). TLS 1.3 only, certificates
required both ways; ``ssl`` checks the chain to the job's CA, :func:`check_peer` checks the
job id, role and cluster from the SAN after the handshake (no hostname checks: relays are
reached by address, identity lives in the certificate).

Layout written by :func:`issue_job_pki`::

    out_dir/ca.pem, out_dir/ca.key              (ca.key never leaves the launching machine)
    out_dir/<cluster>/relay.pem, relay.key
    out_dir/<cluster>/worker-<host>.pem, .key   (keys are created 0600)
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import socket
import ssl
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nebula_cli.errors import NebulaError

log = logging.getLogger("nebula.pki")

SCHEME = "nebula"
ROLES = frozenset({"relay", "worker"})
CLOCK_SKEW = dt.timedelta(minutes=5)
"""How far in the past ``not_before`` is set, so that hosts with slow clocks accept a cert."""
HANDSHAKE_TIMEOUT = 30.0
"""Default bound (seconds) on a TLS handshake in :func:`wrap_server` / :func:`wrap_client`."""

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# OpenSSL X509_V_ERR_* codes that mean "not signed by the CA we trust".
_FOREIGN_CHAIN_CODES = {2, 18, 19, 20, 21}
_EXPIRED = 10
_NOT_YET_VALID = 9


class PeerRejected(NebulaError):
    """A TLS peer was refused: bad chain, wrong job, wrong role or cluster, no certificate."""

    def __init__(self, reason: str, *, peer: str | None = None) -> None:
        super().__init__(f"peer {peer} rejected: {reason}" if peer else f"peer rejected: {reason}")
        self.reason = reason
        self.peer = peer


@dataclass(frozen=True)
class CertPair:
    """Paths of one PEM certificate and its PEM private key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Identity:
    """Who a certificate belongs to, as read from its SAN URI."""

    job_id: str
    role: str
    cluster: str
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}://{self.job_id}/{self.role}/{self.cluster}/{self.name}"


@dataclass
class JobPKI:
    """An issued job PKI directory: the CA and the pair of every relay and worker."""

    ca_cert: Path
    ca_key: Path
    root: Path
    job_id: str
    clusters: dict[str, list[str]] = field(default_factory=dict)

    def relay(self, cluster: str) -> CertPair:
        """The relay pair of ``cluster``."""
        if cluster not in self.clusters:
            raise NebulaError(f"no certificates for cluster {cluster!r} in {self.root}")
        d = self.root / cluster
        return CertPair(d / "relay.pem", d / "relay.key")

    def worker(self, cluster: str, host: str) -> CertPair:
        """The worker pair of ``host`` in ``cluster``."""
        if host not in self.clusters.get(cluster, ()):
            raise NebulaError(f"no certificate for worker {host!r} of cluster {cluster!r}")
        d = self.root / cluster
        return CertPair(d / f"worker-{host}.pem", d / f"worker-{host}.key")


# --------------------------------------------------------------------------- issuing


def _check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise NebulaError(
            f"{kind} {value!r} cannot go in a certificate: use letters, digits, '.', '_' or '-' "
            "(starting with a letter or digit, at most 128 characters)"
        )
    return value


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start (no window with wider permissions)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError as exc:
        raise NebulaError(f"{path} already exists; refusing to overwrite key material") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_pair(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, pair: CertPair) -> None:
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_new(pair.key, key_pem, 0o600)
    _write_new(pair.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _issue_ca(
    job_id: str, not_before: dt.datetime, not_after: dt.datetime
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "nebula"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"nebula CA for job {job_id}"),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"{SCHEME}://{job_id}/ca")]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _issue_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    ident: Identity,
    *,
    not_before: dt.datetime,
    not_after: dt.datetime,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Sign a leaf for ``ident`` with explicit validity (tests use it for expired certs)."""
    key = _new_key()
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "nebula"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ident.job_id),
            x509.NameAttribute(
                NameOID.COMMON_NAME,
                f"{ident.cluster} relay"
                if ident.role == "relay"
                else f"{ident.cluster} worker {ident.name}",
            ),
        ]
    )
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(ident.uri)]), critical=False
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def issue_job_pki(
    job_id: str,
    clusters: dict[str, list[str]],
    out_dir: Path,
    *,
    valid_for: dt.timedelta = dt.timedelta(days=30),
) -> JobPKI:
    """Create the job's CA, one relay pair per cluster and one worker pair per host in ``out_dir``.

    ``clusters`` maps cluster name -> host names. Certificates are valid from a little before now
    (:data:`CLOCK_SKEW`) until now + ``valid_for``. Refuses to overwrite existing key material.
    """
    _check_name("job id", job_id)
    if valid_for <= dt.timedelta(0):
        raise NebulaError(f"certificate lifetime must be positive, got {valid_for}")
    if not clusters:
        raise NebulaError("a job PKI needs at least one cluster")
    for cluster, hosts in clusters.items():
        _check_name("cluster name", cluster)
        for host in hosts:
            _check_name(f"host name in cluster {cluster}", host)
        if len(set(hosts)) != len(hosts):
            raise NebulaError(f"cluster {cluster} lists a host twice: {hosts}")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    now = _now()
    not_before, not_after = now - CLOCK_SKEW, now + valid_for
    ca_cert, ca_key = _issue_ca(job_id, not_before, not_after)
    pki = JobPKI(
        ca_cert=out_dir / "ca.pem",
        ca_key=out_dir / "ca.key",
        root=out_dir,
        job_id=job_id,
        clusters={c: list(h) for c, h in clusters.items()},
    )
    _write_pair(ca_cert, ca_key, CertPair(pki.ca_cert, pki.ca_key))
    for cluster, hosts in clusters.items():
        (out_dir / cluster).mkdir(exist_ok=True)
        todo = [(Identity(job_id, "relay", cluster, "relay"), pki.relay(cluster))]
        todo += [(Identity(job_id, "worker", cluster, h), pki.worker(cluster, h)) for h in hosts]
        for ident, pair in todo:
            cert, key = _issue_leaf(
                ca_cert, ca_key, ident, not_before=not_before, not_after=not_after
            )
            _write_pair(cert, key, pair)
    return pki


def _load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(Path(path).read_bytes())
    except OSError as exc:
        raise NebulaError(f"cannot read certificate {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise NebulaError(f"{path} is not a PEM certificate") from exc


def load_pki(out_dir: Path) -> JobPKI:
    """Reopen a directory written by :func:`issue_job_pki`; job id and hosts come from the certs."""
    root = Path(out_dir)
    ca_cert_path, ca_key_path = root / "ca.pem", root / "ca.key"
    ca = _load_cert(ca_cert_path)
    uris = _san_uris(ca)
    prefix = f"{SCHEME}://"
    ca_uris = [u for u in uris if u.startswith(prefix) and u.endswith("/ca")]
    if len(ca_uris) != 1:
        raise NebulaError(f"{ca_cert_path} is not a nebula job CA")
    job_id = ca_uris[0][len(prefix) : -len("/ca")]
    clusters: dict[str, list[str]] = {}
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        relay = sub / "relay.pem"
        if not relay.is_file():
            continue
        hosts = []
        for pem in [relay, *sorted(sub.glob("worker-*.pem"))]:
            ident = identity_of(_load_cert(pem))
            expected = "relay" if pem == relay else "worker"
            if ident.job_id != job_id or ident.cluster != sub.name or ident.role != expected:
                raise NebulaError(f"{pem} belongs to {ident.uri}, not to this job directory")
            if not pem.with_suffix(".key").is_file():
                raise NebulaError(f"{pem.with_suffix('.key')} is missing")
            if expected == "worker":
                hosts.append(ident.name)
        clusters[sub.name] = hosts
    if not clusters:
        raise NebulaError(f"no relay certificates under {root}")
    return JobPKI(ca_cert_path, ca_key_path, root, job_id, clusters)


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
    return ctx


def server_context(pair: CertPair, ca: Path) -> ssl.SSLContext:
    """Server side: TLS 1.3 only, a client certificate chained to ``ca`` is required."""
    return _context(ssl.PROTOCOL_TLS_SERVER, pair, ca)


def client_context(pair: CertPair, ca: Path) -> ssl.SSLContext:
    """Client side: TLS 1.3 only, presents ``pair``, requires a server cert chained to ``ca``."""
    return _context(ssl.PROTOCOL_TLS_CLIENT, pair, ca)


# --------------------------------------------------------------------------- peer checks


def _san_uris(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return san.get_values_for_type(x509.UniformResourceIdentifier)


def identity_of(cert: x509.Certificate) -> Identity:
    """The nebula identity in ``cert``'s SAN URI; :class:`PeerRejected` if it has none."""
    prefix = f"{SCHEME}://"
    found = [u for u in _san_uris(cert) if u.startswith(prefix)]
    if len(found) != 1:
        raise PeerRejected(f"certificate carries {len(found)} nebula identities, expected 1")
    parts = found[0][len(prefix) :].split("/")
    if len(parts) != 4 or not all(_NAME_RE.fullmatch(p) for p in parts):
        raise PeerRejected(f"malformed nebula identity {found[0]!r}")
    ident = Identity(*parts)
    if ident.role not in ROLES:
        raise PeerRejected(f"unknown role {ident.role!r} in {found[0]!r}")
    return ident


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
) -> tuple[ssl.SSLSocket, Identity]:
    peer = _peer_addr(sock)
    previous = sock.gettimeout()
    sslsock: ssl.SSLSocket | None = None
    try:
        sock.settimeout(timeout)
        sslsock = ctx.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False)
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
) -> tuple[ssl.SSLSocket, Identity]:
    """Client side of a connected socket: TLS handshake, then :func:`check_peer` on the server.

    With TLS 1.3 a server that refuses *our* certificate may only be noticed on the first read.
    """
    return _wrap(
        sock, ctx, server_side=False, job_id=job_id, roles=roles, cluster=cluster, timeout=timeout
    )


__all__ = [
    "CLOCK_SKEW",
    "HANDSHAKE_TIMEOUT",
    "ROLES",
    "CertPair",
    "Identity",
    "JobPKI",
    "PeerRejected",
    "check_peer",
    "client_context",
    "identity_of",
    "issue_job_pki",
    "load_pki",
    "peer_identity",
    "server_context",
    "wrap_client",
    "wrap_server",
]
