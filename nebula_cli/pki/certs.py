"""The job's certificates: a per-job CA, one certificate and key per relay and per worker host,
issued, reopened, renewed and dated. (The TLS contexts and peer checks built on them: `tls`.)

Layout written by :func:`issue_job_pki`::

    out_dir/ca.pem, out_dir/ca.key              (ca.key never leaves the launching machine)
    out_dir/<cluster>/relay.pem, relay.key
    out_dir/<cluster>/worker-<host>.pem, .key   (keys are created 0600, directories 0700)

:func:`renew_job_pki` issues a new CA (a new key) and every certificate again for a new period
(a resume): certificates of earlier attempts no longer chain, so a key taken from a host of an
earlier attempt, or a process of it still running somewhere, is refused by every process of the
new one. Every process of a job starts again on a resume, with the new files;
``bench-network`` issues its own CA per run.
:func:`extend_job_pki` renews a running job's certificates before they expire (the same CA
key certified again, new leaves: old and new chain either way, so processes reload them one by
one with nothing stopped); :func:`renewal_due` says when (a third of the period left).
:func:`expiry` says when the first of them expires, :func:`needs_renewal_warning` whether to warn.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
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
WARN_BEFORE = dt.timedelta(days=7)
"""How long before the certificates expire `nebula status` starts to warn."""

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


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
    _write_new(pair.key, _key_pem(key), 0o600)
    _write_new(pair.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _issue_ca(
    job_id: str, not_before: dt.datetime, not_after: dt.datetime,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed job CA with a new key."""
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
    valid_for: dt.timedelta,
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
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
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
        (out_dir / cluster).mkdir(mode=0o700, exist_ok=True)
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


# --------------------------------------------------------------------------- renewal, expiry


def _replace(path: Path, data: bytes, mode: int) -> None:
    """Atomically replace ``path`` with ``data``, the new file created with ``mode``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    tmp.unlink(missing_ok=True)
    _write_new(tmp, data, mode)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _reissue_leaves(pki: JobPKI, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                    *, not_before: dt.datetime, not_after: dt.datetime) -> None:
    """Every relay and worker of the job given a new key and a certificate signed by `ca_key`,
    each file replaced atomically (the key before its certificate)."""
    for cluster, hosts in pki.clusters.items():
        todo = [(Identity(pki.job_id, "relay", cluster, "relay"), pki.relay(cluster))]
        todo += [(Identity(pki.job_id, "worker", cluster, h), pki.worker(cluster, h))
                 for h in hosts]
        for ident, pair in todo:
            cert, key = _issue_leaf(ca_cert, ca_key, ident, not_before=not_before,
                                    not_after=not_after)
            _replace(pair.key, _key_pem(key), 0o600)
            _replace(pair.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def renew_job_pki(
    out_dir: Path, *, valid_for: dt.timedelta
) -> JobPKI:
    """Issue the certificates of an existing job PKI again, valid from now until now +
    ``valid_for``, under a new CA: a new CA key and certificate (the job id and hosts read from
    the old ones) and a new key and certificate for every relay and worker. Certificates of the
    CA before no longer chain: a resumed job refuses every key of its earlier attempts. Each file
    is replaced atomically (an interrupted renewal is completed by the next one). Used when a
    job resumes."""
    if valid_for <= dt.timedelta(0):
        raise NebulaError(f"certificate lifetime must be positive, got {valid_for}")
    pki = load_pki(out_dir)
    now = _now()
    not_before, not_after = now - CLOCK_SKEW, now + valid_for
    ca_cert, ca_key = _issue_ca(pki.job_id, not_before, not_after)
    _replace(pki.ca_key, _key_pem(ca_key), 0o600)
    _replace(pki.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _reissue_leaves(pki, ca_cert, ca_key, not_before=not_before, not_after=not_after)
    log.info("renewed the certificates of job %s until %s", pki.job_id, not_after.isoformat())
    return pki


def extend_job_pki(out_dir: Path, *, valid_for: dt.timedelta) -> JobPKI:
    """Renew a running job's certificates before they expire, valid from now until now +
    ``valid_for``, with no process stopped: the CA is certified again with the same key and
    name (a new serial and period), and every relay and worker gets a new key and certificate
    signed by that key. Old and new chain to either CA certificate, so a process that has not
    reloaded its files yet and one that has accept each other; each process loads the new
    files for its next handshake (`tls`), and established connections are not touched. Each
    file is replaced atomically (the key before its certificate)."""
    if valid_for <= dt.timedelta(0):
        raise NebulaError(f"certificate lifetime must be positive, got {valid_for}")
    pki = load_pki(out_dir)
    old = _load_cert(pki.ca_cert)
    try:
        ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise NebulaError(f"cannot read the job's CA key {pki.ca_key}: {exc}") from exc
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise NebulaError(f"the job's CA key {pki.ca_key} is not an EC key")
    now = _now()
    not_before, not_after = now - CLOCK_SKEW, now + valid_for
    builder = (x509.CertificateBuilder().subject_name(old.subject).issuer_name(old.subject)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(not_before).not_valid_after(not_after))
    for ext in old.extensions:
        builder = builder.add_extension(ext.value, critical=ext.critical)
    ca_cert = builder.sign(ca_key, hashes.SHA256())
    _replace(pki.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _reissue_leaves(pki, ca_cert, ca_key, not_before=not_before, not_after=not_after)
    log.info("extended the certificates of job %s until %s", pki.job_id, not_after.isoformat())
    return pki


def renewal_due(out_dir: Path, now: dt.datetime | None = None) -> bool:
    """Whether a running job's certificates should be renewed now: a third or less of their
    period is left (a month-long run with lifetime_days 90 renews with 30 days left; a job of
    short-lived certificates, as tests make, within seconds)."""
    pki = load_pki(out_dir)
    cert = _load_cert(pki.ca_cert)
    now = now or dt.datetime.now(dt.UTC)
    period = cert.not_valid_after_utc - cert.not_valid_before_utc
    return now >= expiry(out_dir) - period / 3


def expiry(out_dir: Path) -> dt.datetime:
    """When the first certificate of the job PKI in ``out_dir`` (CA, relays, workers) expires."""
    pki = load_pki(out_dir)
    pems = [pki.ca_cert]
    for cluster, hosts in pki.clusters.items():
        pems += [pki.relay(cluster).cert, *(pki.worker(cluster, h).cert for h in hosts)]
    return min(_load_cert(p).not_valid_after_utc for p in pems)


def needs_renewal_warning(now: dt.datetime, expiry: dt.datetime,
                          week: dt.timedelta = WARN_BEFORE) -> bool:
    """Whether to warn at ``now`` about certificates expiring at ``expiry`` (within ``week``,
    or already expired)."""
    return now >= expiry - week


def expiry_warning(out_dir: Path, now: dt.datetime | None = None) -> str | None:
    """The warning `nebula status` prints for the job PKI in ``out_dir``; None when there is
    nothing to say (no PKI: a job without relays; or far from expiry)."""
    if not (Path(out_dir) / "ca.pem").is_file():
        return None
    now = now or dt.datetime.now(dt.UTC)
    ends = expiry(out_dir)
    if not needs_renewal_warning(now, ends):
        return None
    when = ends.strftime("%Y-%m-%d %H:%M UTC")
    if now >= ends:
        return (f"the job's certificates expired on {when}: relays cannot reconnect; stop the "
                "job and launch it again (a launch issues new certificates)")
    days = (ends - now).total_seconds() / 86400
    return (f"the job's certificates expire on {when} (in {days:.1f} days): after that relays "
            "cannot reconnect; `nebula status` on this machine (it holds the CA key) renews a "
            "running job's certificates once a third of their period (lifetime_days) is left")

