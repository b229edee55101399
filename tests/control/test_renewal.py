"""A running job's certificates renewed by the control plane's look (control/renewal.py): when
due, the job's CA key certifies new ones and every live agent's copies are replaced on its host
(real files through a real LocalTransport; a host that cannot be reached gets them on the next
look); a relay context made from the old files reloads them for its next handshake."""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys
from pathlib import Path

from cryptography import x509

from nebula_cli import pki
from nebula_cli.config import strict
from nebula_cli.config.tunnel_config import TUNNELS_FILE, TunnelConfig, TunnelGrant
from nebula_cli.control import renewal
from nebula_cli.control.state import HostRecord, StateStore
from nebula_cli.errors import TransportError
from nebula_cli.pki.tls import reload_if_renewed
from nebula_cli.transport import LocalTransport

CLUSTERS = {"east": ["e1"], "west": ["w1"]}


def _serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def _agent_dir(root: Path, cluster: str, host: str, role: str, job_pki: pki.JobPKI) -> str:
    d = root / cluster / host / role / "certs"
    d.mkdir(parents=True)
    pair = job_pki.relay(cluster) if role == "relay" else job_pki.worker(cluster, host)
    (d / f"{role}.pem").write_bytes(pair.cert.read_bytes())
    (d / f"{role}.key").write_bytes(pair.key.read_bytes())
    (d / "ca.pem").write_bytes(job_pki.ca_cert.read_bytes())
    return str(d.parent)


def test_a_due_renewal_reaches_every_live_host_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with StateStore(home) as store:
        job = store.create_job("long", {"name": "long", "lifetime_days": 30}, "/x.yaml")
        job_pki = pki.issue_job_pki(job.id, CLUSTERS, store.job_dir(job.id) / "pki",
                                    valid_for=dt.timedelta(days=30))
        for cluster, (host,) in CLUSTERS.items():
            for role in ("relay", "worker"):
                store.upsert_host(HostRecord(
                    job_id=job.id, cluster=cluster, host=host, role=role, node_rank=0, slots=1,
                    agent_dir=_agent_dir(tmp_path / "hosts", cluster, host, role, job_pki),
                    state="RUNNING", detail={"conn": {"transport": "local", "name": host}}))
        relay_dir = Path(next(r for r in store.hosts(job.id) if r.role == "relay").agent_dir)
        relay_ctx = pki.server_context(
            pki.CertPair(relay_dir / "certs/relay.pem", relay_dir / "certs/relay.key"),
            relay_dir / "certs/ca.pem")
        local = LocalTransport("h", home=str(home), python=sys.executable)
        down = {"w1"}

        def transport_of(rec: HostRecord) -> LocalTransport:
            if rec.host in down:
                raise TransportError("cannot reach w1", host=rec.host)
            return local

        def look(at: dt.datetime) -> str | None:  # what `nebula status` does at `at`
            return renewal.renew_if_due(store, job, store.hosts(job.id), transport_of,
                                        _sends_end, at)

        now = dt.datetime.now(dt.UTC)
        assert look(now) is None
        said = look(now + dt.timedelta(days=21))  # a third of the period left: due
        assert said and "renewed until" in said
        new_serial = _serial(job_pki.ca_cert)
        for rec in store.hosts(job.id):
            got = _serial(Path(rec.agent_dir) / "certs" / "ca.pem")
            leaf = x509.load_pem_x509_certificate(
                (Path(rec.agent_dir) / "certs" / f"{rec.role}.pem").read_bytes())
            if rec.host in down:
                assert got != new_serial and rec.detail[renewal.SENT_KEY] == renewal.PENDING
            else:
                assert got == new_serial and rec.detail[renewal.SENT_KEY] == str(new_serial)
                assert leaf.not_valid_after_utc > now + dt.timedelta(days=29)
        assert reload_if_renewed(relay_ctx)  # the relay's next handshake uses them
        kinds = [e.message for e in store.events(job.id) if e.kind == renewal.RENEWED_EVENT]
        assert any("not sent to west/w1" in m for m in kinds)

        down.clear()  # w1 is back: the next look sends its files, once
        assert look(now) is None  # (renewed a moment ago: not due)
        assert {_serial(Path(r.agent_dir) / "certs" / "ca.pem")
                for r in store.hosts(job.id)} == {new_serial}
        stamps = {r.agent_dir: (Path(r.agent_dir) / "certs" / "ca.pem").stat().st_mtime_ns
                  for r in store.hosts(job.id)}
        look(now)
        assert stamps == {r.agent_dir: (Path(r.agent_dir) / "certs" / "ca.pem").stat()
                          .st_mtime_ns for r in store.hosts(job.id)}  # not sent again


def _sends_end() -> None:
    """Local writes end by themselves: nothing to cancel."""


def test_a_renewal_moves_the_tunnel_keys_cap_to_the_new_certificates_end(
        tmp_path: Path) -> None:
    """The relay that lets tunnel keys in gets its tunnels.json again with the grants capped at
    the renewed certificates' end (the relay that dials keeps its file as it was)."""
    home = tmp_path / "home"
    with StateStore(home) as store:
        job = store.create_job("long", {"name": "long", "lifetime_days": 30}, "/x.yaml")
        pki_dir = store.job_dir(job.id) / "pki"
        job_pki = pki.issue_job_pki(job.id, CLUSTERS, pki_dir, valid_for=dt.timedelta(days=3))
        old_end = int(pki.expiry(pki_dir).timestamp())
        grant = TunnelGrant(peer="west", authorized_keys="~/.ssh/authorized_keys",
                            public_key="ssh-ed25519 AAAAx", targets=["127.0.0.1:29400"],
                            expires=old_end, tag=f"nebula-tunnel:{job.id}:west>east")
        parts = {"east": TunnelConfig(job_id=job.id, cluster="east", keepalive=5,
                                      keepalive_count=3, grant_ttl=900, dial=[], grant=[grant]),
                 "west": TunnelConfig(job_id=job.id, cluster="west", keepalive=5,
                                      keepalive_count=3, grant_ttl=900, dial=[], grant=[])}
        for cluster, (host,) in CLUSTERS.items():
            adir = _agent_dir(tmp_path / "hosts", cluster, host, "relay", job_pki)
            strict.write(parts[cluster], Path(adir) / TUNNELS_FILE)
            store.upsert_host(HostRecord(
                job_id=job.id, cluster=cluster, host=host, role="relay", node_rank=0, slots=1,
                agent_dir=adir, state="RUNNING",
                detail={"conn": {"transport": "local", "name": host}}))
        local = LocalTransport("h", home=str(home), python=sys.executable)
        dialler = tmp_path / "hosts" / "west" / "w1" / "relay" / TUNNELS_FILE
        before = dialler.read_bytes()
        said = renewal.renew_if_due(store, job, store.hosts(job.id), lambda _: local, _sends_end,
                                    dt.datetime.now(dt.UTC) + dt.timedelta(days=2, hours=12))
        assert said and "renewed until" in said
        new_end = int(pki.expiry(pki_dir).timestamp())
        assert new_end > old_end + 20 * 86400
        east = TunnelConfig.load(tmp_path / "hosts" / "east" / "e1" / "relay" / TUNNELS_FILE)
        assert east == dataclasses.replace(
            parts["east"], grant=[dataclasses.replace(grant, expires=new_end)])
        assert dialler.read_bytes() == before
