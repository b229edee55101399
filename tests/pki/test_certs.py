"""Tests of nebula_cli.pki: issued files, and real TLS 1.3 handshakes over loopback sockets."""

from __future__ import annotations

import datetime as dt
import logging
import os
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from helpers.tls_handshake import handshake

from nebula_cli import pki
from nebula_cli.errors import NebulaError
from nebula_cli.pki import (
    CertPair,
    Identity,
    JobPKI,
    PeerRejected,
    client_context,
    issue_job_pki,
    load_pki,
    server_context,
)

DAY = dt.timedelta(days=1)
JOB = "train-20250101-000000-ab12"
CLUSTERS = {"alpha": ["a1", "a2.example.org"], "beta": ["b1"]}
TIMEOUT = 5.0


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> JobPKI:
    return issue_job_pki(JOB, CLUSTERS, tmp_path_factory.mktemp("pki") / "job", valid_for=DAY)


@pytest.fixture(scope="module")
def other_job(tmp_path_factory: pytest.TempPathFactory) -> JobPKI:
    return issue_job_pki("other-job", {"alpha": ["a1"]}, tmp_path_factory.mktemp("pki2") / "job",
                         valid_for=DAY)


def _craft(job: JobPKI, ident: Identity, out: Path, **validity: dt.datetime) -> CertPair:
    """A pair for ``ident`` signed by ``job``'s CA (identities issue_job_pki never makes)."""
    ca_cert = x509.load_pem_x509_certificate(job.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(job.ca_key.read_bytes(), password=None)
    now = dt.datetime.now(dt.UTC)
    cert, key = pki._issue_leaf(
        ca_cert,
        ca_key,
        ident,
        not_before=validity.get("not_before", now - dt.timedelta(minutes=1)),
        not_after=validity.get("not_after", now + dt.timedelta(hours=1)),
    )
    out.mkdir(parents=True, exist_ok=True)
    pair = CertPair(out / "crafted.pem", out / "crafted.key")
    pki._write_pair(cert, key, pair)
    return pair


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, *,
               job_id: str = JOB, **kwargs: object) -> dict[str, object]:
    return handshake(server_ctx, client_ctx, job_id=job_id, **kwargs)  # type: ignore[arg-type]


def _rejected(result: object, *needles: str) -> PeerRejected:
    assert isinstance(result, PeerRejected), f"expected PeerRejected, got {result!r}"
    for needle in needles:
        assert needle in result.reason, result.reason
    assert result.peer and result.peer.startswith("127.0.0.1:")
    return result


# --------------------------------------------------------------------------- issued files


def test_layout_and_key_modes(tmp_path: Path) -> None:
    old = os.umask(0)  # keys must be 0600 whatever the umask
    try:
        job = issue_job_pki(JOB, CLUSTERS, tmp_path / "job", valid_for=DAY)
    finally:
        os.umask(old)
    expected = {"ca.pem", "ca.key"}
    for cluster, hosts in CLUSTERS.items():
        expected |= {f"{cluster}/relay.pem", f"{cluster}/relay.key"}
        expected |= {f"{cluster}/worker-{h}.{ext}" for h in hosts for ext in ("pem", "key")}
    found = {str(p.relative_to(job.root)) for p in job.root.rglob("*") if p.is_file()}
    assert found == expected
    keys = list(job.root.rglob("*.key"))
    assert len(keys) == 1 + 2 + 3
    for key in keys:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert job.relay("beta") == CertPair(job.root / "beta/relay.pem", job.root / "beta/relay.key")
    assert job.worker("alpha", "a1").cert == job.root / "alpha/worker-a1.pem"
    with pytest.raises(NebulaError, match="gamma"):
        job.relay("gamma")
    with pytest.raises(NebulaError, match="b9"):
        job.worker("beta", "b9")


def test_refuses_overwrite_and_bad_names(job: JobPKI, tmp_path: Path) -> None:
    with pytest.raises(NebulaError, match="already exists"):
        issue_job_pki(JOB, CLUSTERS, job.root, valid_for=DAY)
    with pytest.raises(NebulaError, match="cluster name"):
        issue_job_pki(JOB, {"a/b": ["h"]}, tmp_path / "x", valid_for=DAY)
    with pytest.raises(NebulaError, match="host name"):
        issue_job_pki(JOB, {"a": ["../h"]}, tmp_path / "y", valid_for=DAY)
    with pytest.raises(NebulaError, match="positive"):
        issue_job_pki(JOB, {"a": ["h"]}, tmp_path / "z", valid_for=dt.timedelta(0))


def test_load_pki_round_trip(job: JobPKI) -> None:
    loaded = load_pki(job.root)
    assert loaded.job_id == JOB
    assert loaded.clusters == {c: sorted(h) for c, h in CLUSTERS.items()}
    assert (loaded.ca_cert, loaded.ca_key) == (job.ca_cert, job.ca_key)
    assert loaded.worker("alpha", "a2.example.org") == job.worker("alpha", "a2.example.org")


def test_certificate_contents_and_validity(tmp_path: Path) -> None:
    valid_for = dt.timedelta(hours=6)
    before = dt.datetime.now(dt.UTC)
    job = issue_job_pki(JOB, {"alpha": ["a1"]}, tmp_path / "job", valid_for=valid_for)
    after = dt.datetime.now(dt.UTC)
    ca = x509.load_pem_x509_certificate(job.ca_cert.read_bytes())
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    for pair, ident in [
        (job.relay("alpha"), Identity(JOB, "relay", "alpha", "relay")),
        (job.worker("alpha", "a1"), Identity(JOB, "worker", "alpha", "a1")),
    ]:
        cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
        assert pki.identity_of(cert) == ident
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"nebula://{JOB}/{ident.role}/alpha/{ident.name}"
        ]
        cn = cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value
        assert "alpha" in cn
        assert cert.issuer == ca.subject
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        assert ku.digital_signature and not ku.key_cert_sign
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        slack = dt.timedelta(seconds=2)
        nb, na = cert.not_valid_before_utc, cert.not_valid_after_utc
        assert before - pki.CLOCK_SKEW - slack <= nb <= after - pki.CLOCK_SKEW
        assert before + valid_for - slack <= na <= after + valid_for
        assert ca.not_valid_before_utc <= nb and na <= ca.not_valid_after_utc


def test_contexts_are_tls13_mutual(job: JobPKI) -> None:
    for ctx in (server_context(job.relay("alpha"), job.ca_cert),
                client_context(job.relay("alpha"), job.ca_cert)):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.check_hostname is False
    with pytest.raises(NebulaError, match="missing"):
        server_context(CertPair(job.root / "nope.pem", job.root / "nope.key"), job.ca_cert)


# --------------------------------------------------------------------------- handshakes


def test_relay_to_relay_both_ways(job: JobPKI) -> None:
    for srv, cli in [("alpha", "beta"), ("beta", "alpha")]:
        out = _handshake(
            server_context(job.relay(srv), job.ca_cert),
            client_context(job.relay(cli), job.ca_cert),
            server_roles={"relay"},
        )
        s_ident, s_version, s_data = out["server"]
        c_ident, c_version, c_data = out["client"]
        assert s_ident == Identity(JOB, "relay", cli, "relay")
        assert c_ident == Identity(JOB, "relay", srv, "relay")
        assert s_version == c_version == "TLSv1.3"
        assert (s_data, c_data) == (b"ping", b"pong")


def test_worker_to_its_relay(job: JobPKI) -> None:
    out = _handshake(
        server_context(job.relay("alpha"), job.ca_cert),
        client_context(job.worker("alpha", "a2.example.org"), job.ca_cert),
        server_roles={"worker"},
        server_cluster="alpha",
    )
    s_ident, version, data = out["server"]
    assert s_ident == Identity(JOB, "worker", "alpha", "a2.example.org")
    assert version == "TLSv1.3" and data == b"ping"
    assert out["client"][0] == Identity(JOB, "relay", "alpha", "relay")


def test_worker_where_relay_required(job: JobPKI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="nebula.pki")
    out = _handshake(
        server_context(job.relay("alpha"), job.ca_cert),
        client_context(job.worker("beta", "b1"), job.ca_cert),
        server_roles={"relay"},
    )
    exc = _rejected(out["server"], "worker certificate presented where a relay is required")
    # the server closed the connection: the client cannot get an answer
    assert not (isinstance(out["client"], tuple) and out["client"][2] == b"pong")
    warnings = [
        r for r in caplog.records if r.name == "nebula.pki" and r.levelno == logging.WARNING
    ]
    assert any(exc.reason in r.getMessage() and exc.peer in r.getMessage() for r in warnings)


def test_worker_of_another_cluster(job: JobPKI) -> None:
    out = _handshake(
        server_context(job.relay("alpha"), job.ca_cert),
        client_context(job.worker("beta", "b1"), job.ca_cert),
        server_roles={"worker"},
        server_cluster="alpha",
    )
    _rejected(out["server"], "certificate of cluster beta, expected alpha")


def test_client_of_another_job_ca(job: JobPKI, other_job: JobPKI) -> None:
    # The client trusts our CA (it is public) but holds a cert of another job's CA.
    out = _handshake(
        server_context(job.relay("alpha"), job.ca_cert),
        client_context(other_job.relay("alpha"), job.ca_cert),
        server_roles={"relay"},
    )
    _rejected(out["server"], "not issued by this job's CA")
    # A client of the other job that also trusts only its own CA refuses our server first;
    # the server sees its alert and still refuses the connection with a reason.
    out = _handshake(
        server_context(job.relay("alpha"), job.ca_cert),
        client_context(other_job.relay("alpha"), other_job.ca_cert),
        server_roles={"relay"},
    )
    _rejected(out["client"], "not issued by this job's CA")
    _rejected(out["server"], "not issued by its job's CA")


def test_server_of_another_job_ca(job: JobPKI, other_job: JobPKI) -> None:
    out = _handshake(
        server_context(other_job.relay("alpha"), other_job.ca_cert),
        client_context(job.relay("beta"), job.ca_cert),
        server_roles={"relay"},
    )
    _rejected(out["client"], "not issued by this job's CA")
    assert isinstance(out["server"], PeerRejected)  # the client's alert ends the server side too


def test_same_ca_but_other_job_id(job: JobPKI, tmp_path: Path) -> None:
    forged = _craft(job, Identity("other-job", "relay", "beta", "relay"), tmp_path)
    out = _handshake(
        server_context(job.relay("alpha"), job.ca_cert),
        client_context(forged, job.ca_cert),
        server_roles={"relay"},
    )
    _rejected(out["server"], f"certificate of job other-job, expected {JOB}")
    # and the other way round: a server with that cert is refused by the client
    out = _handshake(
        server_context(forged, job.ca_cert),
        client_context(job.relay("alpha"), job.ca_cert),
        server_roles={"relay"},
    )
    _rejected(out["client"], f"certificate of job other-job, expected {JOB}")


def test_no_client_certificate(job: JobPKI) -> None:
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.check_hostname = False
    bare.load_verify_locations(cafile=str(job.ca_cert))
    out = _handshake(
        server_context(job.relay("alpha"), job.ca_cert), bare, server_roles={"relay"}
    )
    _rejected(out["server"], "no certificate")


def test_expired_certificate(job: JobPKI, tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    expired = _craft(
        job,
        Identity(JOB, "relay", "beta", "relay"),
        tmp_path,
        not_before=now - dt.timedelta(days=2),
        not_after=now - dt.timedelta(days=1),
    )
    out = _handshake(
        server_context(job.relay("alpha"), job.ca_cert),
        client_context(expired, job.ca_cert),
        server_roles={"relay"},
    )
    _rejected(out["server"], "expired")
    out = _handshake(
        server_context(expired, job.ca_cert),
        client_context(job.relay("alpha"), job.ca_cert),
        server_roles={"relay"},
    )
    _rejected(out["client"], "expired")


def test_tls12_client_refused(job: JobPKI) -> None:
    old = client_context(job.relay("beta"), job.ca_cert)
    old.minimum_version = ssl.TLSVersion.TLSv1_2
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    out = _handshake(
        server_context(job.relay("alpha"), job.ca_cert), old, server_roles={"relay"}
    )
    _rejected(out["server"], "TLS")
    assert isinstance(out["client"], PeerRejected)


def test_silent_client_times_out(job: JobPKI) -> None:
    out = _handshake(
        server_context(job.relay("alpha"), job.ca_cert),
        client_context(job.relay("beta"), job.ca_cert),
        server_roles={"relay"},
        server_timeout=0.3,
        client_sends=False,
    )
    _rejected(out["server"], "timed out")


def test_check_peer_rejects_bad_roles_argument(job: JobPKI) -> None:
    out = _handshake(
        server_context(job.relay("alpha"), job.ca_cert),
        client_context(job.relay("beta"), job.ca_cert),
        server_roles={"admin"},
    )
    assert isinstance(out["server"], ValueError)


# --------------------------------------------------------------------------- lifetime, renewal


def _days_left(when: dt.datetime) -> float:
    return (when - dt.datetime.now(dt.UTC)).total_seconds() / 86400


def test_the_lifetime_comes_from_the_spec_only(tmp_path: Path) -> None:
    import inspect

    from nebula_cli.config.spec import JobSpec

    for fn in (issue_job_pki, pki.renew_job_pki):  # no default of their own
        assert inspect.signature(fn).parameters["valid_for"].default is inspect.Parameter.empty
    days = JobSpec.model_fields["lifetime_days"].default
    job = issue_job_pki(JOB, {"alpha": ["a1"]}, tmp_path / "job",
                        valid_for=dt.timedelta(days=days))
    assert abs(_days_left(pki.expiry(job.root)) - days) < 0.01
    assert stat.S_IMODE(job.root.stat().st_mode) == 0o700
    assert stat.S_IMODE((job.root / "alpha").stat().st_mode) == 0o700


def test_renewal_reissues_every_certificate_under_a_new_ca(tmp_path: Path) -> None:
    job = issue_job_pki(JOB, CLUSTERS, tmp_path / "job", valid_for=dt.timedelta(days=2))
    assert 1.99 < _days_left(pki.expiry(job.root)) < 2.01
    old = tmp_path / "old"
    old.mkdir()
    old_relay = CertPair(old / "relay.pem", old / "relay.key")
    old_relay.cert.write_bytes(job.relay("alpha").cert.read_bytes())
    old_relay.key.write_bytes(job.relay("alpha").key.read_bytes())
    (old / "ca.pem").write_bytes(job.ca_cert.read_bytes())
    ca_key = job.ca_key.read_bytes()
    worker_key = job.worker("beta", "b1").key.read_bytes()

    renewed = pki.renew_job_pki(job.root, valid_for=dt.timedelta(days=400))
    assert renewed.clusters == job.clusters and renewed.job_id == JOB
    assert 399.99 < _days_left(pki.expiry(job.root)) < 400.01
    assert job.ca_key.read_bytes() != ca_key  # a new CA (tests/pki/test_certs_renewal.py)
    assert stat.S_IMODE(job.ca_key.stat().st_mode) == 0o600
    assert job.worker("beta", "b1").key.read_bytes() != worker_key  # leaf keys are new
    for cluster, hosts in CLUSTERS.items():
        for pair in [job.relay(cluster), *(job.worker(cluster, h) for h in hosts)]:
            assert stat.S_IMODE(pair.key.stat().st_mode) == 0o600
            assert _days_left(x509.load_pem_x509_certificate(
                pair.cert.read_bytes()).not_valid_after_utc) > 399
    assert not list(job.root.rglob(".*.new"))
    # a relay still holding its old certificate and the old CA is refused by a renewed one,
    # both ways; renewed relays reach each other
    for server, client in [(old_relay, job.relay("beta")), (job.relay("beta"), old_relay)]:
        out = _handshake(server_context(server, old / "ca.pem" if server is old_relay
                                        else job.ca_cert),
                         client_context(client, job.ca_cert if server is old_relay
                                        else old / "ca.pem"),
                         server_roles={"relay"})
        assert isinstance(out["server"], PeerRejected) or isinstance(out["client"],
                                                                     PeerRejected), out
    out = _handshake(server_context(job.relay("alpha"), job.ca_cert),
                     client_context(job.relay("beta"), job.ca_cert), server_roles={"relay"})
    assert out["server"][2] == b"ping" and out["client"][2] == b"pong", out


def test_renewal_refuses_a_lifetime_that_is_not_positive(job: JobPKI) -> None:
    before = {p: p.read_bytes() for p in job.root.rglob("*") if p.is_file()}
    with pytest.raises(NebulaError, match="must be positive"):
        pki.renew_job_pki(job.root, valid_for=dt.timedelta(0))
    assert {p: p.read_bytes() for p in job.root.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(("left", "warn"), [(dt.timedelta(days=30), False),
                                            (dt.timedelta(days=7, seconds=1), False),
                                            (dt.timedelta(days=7), True),
                                            (dt.timedelta(hours=1), True),
                                            (-dt.timedelta(days=1), True)])
def test_needs_renewal_warning(left: dt.timedelta, warn: bool) -> None:
    now = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.UTC)
    assert pki.needs_renewal_warning(now, now + left, dt.timedelta(days=7)) is warn
    assert pki.needs_renewal_warning(now, now + left) is warn  # WARN_BEFORE is a week


def test_expiry_warning_texts(tmp_path: Path) -> None:
    assert pki.expiry_warning(tmp_path / "no-pki") is None
    soon = issue_job_pki(JOB, {"alpha": ["a1"]}, tmp_path / "soon", valid_for=dt.timedelta(days=3))
    text = pki.expiry_warning(soon.root)
    assert text is not None and "expire on" in text and "in 3.0 days" in text
    assert "lifetime_days" in text
    later = pki.expiry(soon.root) + dt.timedelta(hours=1)
    assert "expired on" in (pki.expiry_warning(soon.root, now=later) or "")
    far = issue_job_pki(JOB, {"alpha": ["a1"]}, tmp_path / "far", valid_for=dt.timedelta(days=60))
    assert pki.expiry_warning(far.root) is None
