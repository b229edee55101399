"""A running job's certificates renewed before they expire, and sent to its hosts.

A job runs longer than its certificates when it outlives `lifetime_days`; after the expiry a
relay whose link drops could not connect again. The control plane's look at a running job
(`JobOps.refresh`: `nebula status`, the live view) renews them once a third of their period is
left (`pki.renewal_due`): the same CA key certified again and new leaves
(`pki.extend_job_pki`), then each agent's copies replaced on its host (key, certificate, CA, each
atomically). Every relay and worker loads them before its next handshake (`pki.tls`); nothing
is stopped and established connections go on. A relay that lets tunnel keys in (its
tunnels.json has grants) gets that file again with the grants' `expires` moved to the new
certificates' end: its `tunnel run` reads it before its next renewal of the key lines
(`agent.grants`), so a dropped tunnel can come back after the first `lifetime_days`.

This needs the machine that holds the job's `$NEBULA_HOME` (the CA key never leaves it): a job
of a month or more needs a `nebula status` (or the live view) in the last third of its
certificates' period. A host that cannot be reached keeps its old files; the next look sends
them again (each renewal is recorded in the job's events).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import posixpath
from collections.abc import Callable
from pathlib import Path

from nebula_cli import pki
from nebula_cli.config import plan_model, strict
from nebula_cli.config.tunnel_config import TUNNELS_FILE, TunnelConfig
from nebula_cli.control.fanout import GroupError, fanout
from nebula_cli.control.state import END_STATES, HostRecord, JobRecord, StateStore
from nebula_cli.errors import NebulaError
from nebula_cli.transport import Transport

RENEWED_EVENT = "certificates-renewed"
SENT_KEY = "certs_serial"
"""A host record's detail: the serial of the CA certificate whose files it was sent (none: the
files its launch wrote; `PENDING`: a renewal's files not sent yet)."""
PENDING = "pending"


def _pair_of(job_pki: pki.JobPKI, rec: HostRecord) -> pki.CertPair | None:
    if rec.role == plan_model.RELAY:
        return job_pki.relay(rec.cluster)
    if rec.host in job_pki.clusters.get(rec.cluster, []):
        return job_pki.worker(rec.cluster, rec.host)
    return None


def _ca_serial(ca: Path) -> str:
    from cryptography import x509

    return str(x509.load_pem_x509_certificate(ca.read_bytes()).serial_number)


def extend_tunnel_keys(transport: Transport, agent_dir: str, until: dt.datetime) -> bool:
    """Move the cap of the tunnel keys a relay lets in (its tunnels.json's grants) to `until`,
    the renewed certificates' end; whether there was a grant to move."""
    path = posixpath.join(agent_dir, TUNNELS_FILE)
    data = transport.read_file(path)
    if data is None:
        return False
    cfg = strict.from_dict(TunnelConfig, json.loads(data), path)
    if not cfg.grant:
        return False
    cap = int(until.timestamp())
    grants = [dataclasses.replace(g, expires=cap) for g in cfg.grant]
    transport.put_bytes(strict.dumps(dataclasses.replace(cfg, grant=grants)), path, mode=0o600)
    return True


def renew_if_due(store: StateStore, job: JobRecord, hosts: list[HostRecord],
                 transport_of: Callable[[HostRecord], Transport], cancel: Callable[[], None],
                 now: dt.datetime | None = None) -> str | None:
    """Renew a running job's certificates when due and send every host that lacks them its
    files (`cancel` ends the sends in flight, as `fanout` asks); what was renewed, or None."""
    pki_dir = store.job_dir(job.id) / "pki"
    if not (pki_dir / "ca.key").is_file():
        return None  # a job without relays has no certificates
    said = None
    if pki.renewal_due(pki_dir, now):
        days = int(job.spec.get("lifetime_days") or 90)
        pki.extend_job_pki(pki_dir, valid_for=dt.timedelta(days=days))
        said = f"certificates renewed until {pki.expiry(pki_dir):%Y-%m-%d %H:%M} UTC"
        store.add_event(job.id, RENEWED_EVENT, said)
        for rec in hosts:  # every host owes the new files until they are sent
            rec.detail[SENT_KEY] = PENDING
            store.upsert_host(rec)
    job_pki = pki.load_pki(pki_dir)
    serial = _ca_serial(job_pki.ca_cert)
    until = pki.expiry(pki_dir)
    todo = [h for h in hosts if h.state not in END_STATES
            and h.detail.get(SENT_KEY, serial) != serial]  # none: the launch's files
    if not todo:
        return said

    def send(i: int) -> None:
        rec = todo[i]
        pair = _pair_of(job_pki, rec)
        if pair is None:
            raise NebulaError(f"no certificate of {rec.cluster}/{rec.host} in {pki_dir}")
        transport = transport_of(rec)
        ca, cert, key = (posixpath.join(rec.agent_dir, n) for n in plan_model.cert_names(rec.role))
        transport.put_bytes(pair.key.read_bytes(), key, mode=0o600)  # the key first: a process
        transport.put_bytes(pair.cert.read_bytes(), cert, mode=0o600)  # reading between the
        transport.put_bytes(job_pki.ca_cert.read_bytes(), ca, mode=0o600)  # two waits
        if rec.role == plan_model.RELAY:
            extend_tunnel_keys(transport, rec.agent_dir, until)

    try:
        done = fanout(list(range(len(todo))), send, timeout=120, cancel=cancel)
    except GroupError as exc:
        done = {k: v for k, v in exc.results.items() if not isinstance(v, BaseException)}
        failed = [f"{todo[k].cluster}/{todo[k].host}" for k in exc.failures]  # type: ignore[index]
        store.add_event(job.id, RENEWED_EVENT, "renewed certificates not sent to "
                        f"{', '.join(failed)} yet (unreachable); the next look sends them")
    for k in done:
        rec = todo[k]  # type: ignore[index]
        rec.detail[SENT_KEY] = serial
        store.upsert_host(rec)
    return said
