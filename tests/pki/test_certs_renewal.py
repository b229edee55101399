"""A resume retires every certificate of the attempts before it (nebula_cli.pki.certs.
renew_job_pki issues a new CA): a key copied off a host of an earlier attempt, or a process of
it still running somewhere, is refused in a real TLS 1.3 handshake by the new relays and worker
ports, in both directions, while every process of the new attempt (relays, workers) still
reaches the others. An interrupted renewal is completed by the next one.

REALWORLD rows: weeks-long runs (stopped and resumed), hosts shared with other users (a key
left on a host)."""

from __future__ import annotations

import datetime as dt
import shutil
import stat
from pathlib import Path

import pytest
from helpers.tls_handshake import handshake

from nebula_cli.pki import (
    CertPair,
    JobPKI,
    PeerRejected,
    certs,
    client_context,
    issue_job_pki,
    renew_job_pki,
    server_context,
)

JOB = "job-20260101-000000-renew"
CLUSTERS = {"east": ["e1", "e2"], "west": ["w1"]}
LIFETIME = dt.timedelta(days=3)


def keep_copy(pair: CertPair, ca: Path, where: Path) -> tuple[CertPair, Path]:
    """What a host of the earlier attempt still holds: its pair and the CA it trusted."""
    where.mkdir(parents=True)
    kept = CertPair(where / pair.cert.name, where / pair.key.name)
    for src, dst in ((pair.cert, kept.cert), (pair.key, kept.key), (ca, where / "ca.pem")):
        shutil.copy(src, dst)
    return kept, where / "ca.pem"


@pytest.fixture
def resumed(tmp_path: Path) -> tuple[JobPKI, dict[str, tuple[CertPair, Path]]]:
    """A job's PKI renewed once (a resume), and copies of what the first attempt's east relay
    and east worker e1 held."""
    job = issue_job_pki(JOB, CLUSTERS, tmp_path / "pki", valid_for=LIFETIME)
    old = {"relay": keep_copy(job.relay("east"), job.ca_cert, tmp_path / "old-relay"),
           "worker": keep_copy(job.worker("east", "e1"), job.ca_cert, tmp_path / "old-worker")}
    renewed = renew_job_pki(job.root, valid_for=LIFETIME)
    return renewed, old


def refused(out: dict[str, object], side: str) -> PeerRejected:
    got = out[side]
    assert isinstance(got, PeerRejected), out
    return got


def test_a_relay_key_of_the_attempt_before_is_refused_after_resume(
        resumed: tuple[JobPKI, dict[str, tuple[CertPair, Path]]]) -> None:
    """Whoever holds the old key trusts what they like (the new CA certificate is no secret):
    the side of the resumed attempt refuses them, dialled or dialling."""
    job, old = resumed
    old_relay, _ = old["relay"]
    out = handshake(server_context(job.relay("west"), job.ca_cert),
                    client_context(old_relay, job.ca_cert), server_roles={"relay"}, job_id=JOB)
    assert "not issued by this job's CA" in refused(out, "server").reason
    assert not isinstance(out.get("client"), tuple) or out["client"][2] != b"pong", out
    out = handshake(server_context(old_relay, job.ca_cert),
                    client_context(job.relay("west"), job.ca_cert), server_roles={"relay"},
                    job_id=JOB)
    assert "not issued by this job's CA" in refused(out, "client").reason


def test_a_process_left_from_the_attempt_before_cannot_join_either_way(
        resumed: tuple[JobPKI, dict[str, tuple[CertPair, Path]]]) -> None:
    """A relay of the earlier attempt still running, with the files it had: no link."""
    job, old = resumed
    old_relay, old_ca = old["relay"]
    for server, client in [(server_context(job.relay("west"), job.ca_cert),
                            client_context(old_relay, old_ca)),
                           (server_context(old_relay, old_ca),
                            client_context(job.relay("west"), job.ca_cert))]:
        out = handshake(server, client, server_roles={"relay"}, job_id=JOB)
        assert isinstance(out["server"], PeerRejected) and isinstance(
            out["client"], PeerRejected), out


def test_a_worker_key_of_the_attempt_before_is_refused_by_the_resumed_worker_port(
        resumed: tuple[JobPKI, dict[str, tuple[CertPair, Path]]]) -> None:
    job, old = resumed
    old_worker, _ = old["worker"]
    out = handshake(server_context(job.relay("east"), job.ca_cert),
                    client_context(old_worker, job.ca_cert), server_roles={"worker"},
                    server_cluster="east", job_id=JOB)
    assert "not issued by this job's CA" in refused(out, "server").reason


def test_every_process_of_the_resumed_attempt_reaches_the_others(
        resumed: tuple[JobPKI, dict[str, tuple[CertPair, Path]]]) -> None:
    job, _ = resumed
    pairs = [(job.relay("east"), job.relay("west"), {"relay"}, None),
             (job.relay("west"), job.relay("east"), {"relay"}, None),
             (job.relay("east"), job.worker("east", "e2"), {"worker"}, "east"),
             (job.relay("west"), job.worker("west", "w1"), {"worker"}, "west")]
    for server, client, roles, cluster in pairs:
        out = handshake(server_context(server, job.ca_cert), client_context(client, job.ca_cert),
                        server_roles=roles, server_cluster=cluster, job_id=JOB)
        assert out["server"][2] == b"ping" and out["client"][2] == b"pong", out


def test_each_renewal_has_its_own_ca_key_kept_private(tmp_path: Path) -> None:
    job = issue_job_pki(JOB, CLUSTERS, tmp_path / "pki", valid_for=LIFETIME)
    keys = [job.ca_key.read_bytes()]
    for _ in range(2):
        renew_job_pki(job.root, valid_for=LIFETIME)
        keys.append(job.ca_key.read_bytes())
        assert stat.S_IMODE(job.ca_key.stat().st_mode) == 0o600
    assert len(set(keys)) == 3


def test_an_interrupted_renewal_is_completed_by_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A renewal that stops after the new CA was written (leaves of the old CA still on disk)
    leaves files that no longer chain; the next resume's renewal makes them whole again."""
    job = issue_job_pki(JOB, CLUSTERS, tmp_path / "pki", valid_for=LIFETIME)
    real, calls = certs._replace, []

    def fail_after_the_ca(path: Path, data: bytes, mode: int) -> None:
        calls.append(path)
        if len(calls) > 3:
            raise OSError("disk full")
        real(path, data, mode)

    monkeypatch.setattr(certs, "_replace", fail_after_the_ca)
    with pytest.raises(OSError):
        renew_job_pki(job.root, valid_for=LIFETIME)
    monkeypatch.setattr(certs, "_replace", real)
    renewed = renew_job_pki(job.root, valid_for=LIFETIME)
    out = handshake(server_context(renewed.relay("east"), renewed.ca_cert),
                    client_context(renewed.relay("west"), renewed.ca_cert),
                    server_roles={"relay"}, job_id=JOB)
    assert out["server"][2] == b"ping" and out["client"][2] == b"pong", out
