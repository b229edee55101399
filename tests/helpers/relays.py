"""Relays for real on 127.0.0.1: a job PKI (`Job`), relay processes (`running`,
`start_relay_process`), RelayClients (`clients`), rounds run together, exact means, free ports,
JSON-lines reads."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from helpers.jobs import REPO
from helpers.plan_defaults import relay_defaults
from helpers.sshd_bed import free_port

from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.pki import JobPKI, issue_job_pki
from nebula_cli.relay.process.client import RelayClient
from nebula_cli.relay.process.server import Relay

JOB = "job-relay"


class Job:
    """A job's PKI and one RelayConfig per cluster (addresses on loopback)."""

    def __init__(self, tmp: Path, clusters: list[str], job_id: str = JOB, **overrides: Any):
        self.tmp = tmp
        self.clusters = clusters
        self.pki: JobPKI = issue_job_pki(job_id, {c: ["h0", "h1"] for c in clusters},
                                         tmp / f"pki-{job_id}", valid_for=DAY)
        ports = free_ports(2 * len(clusters))
        self.peer = {c: f"127.0.0.1:{ports[2 * i]}" for i, c in enumerate(clusters)}
        self.work = {c: f"127.0.0.1:{ports[2 * i + 1]}" for i, c in enumerate(clusters)}
        self.cfg = {}
        for c in clusters:
            pair = self.pki.relay(c)
            # exact expectations: no error feedback unless a test asks for it
            opts = relay_defaults(**{"codec": "none", "error_feedback": False,
                                     "round_timeout": 5.0, "heartbeat": 1.0,
                                     "chunk_numel": 1024, **overrides})
            self.cfg[c] = RelayConfig(
                job_id=job_id, cluster=c, clusters=clusters, peer_listen=self.peer[c],
                worker_listen=self.work[c], peers={o: self.peer[o] for o in clusters if o != c},
                tls={"ca": str(self.pki.ca_cert), "cert": str(pair.cert), "key": str(pair.key)},
                status_file=str(tmp / f"status-{c}.json"),
                metrics_file=str(tmp / f"metrics-{c}.jsonl"), **opts)

    def client(self, c: str, **kw: Any) -> RelayClient:
        pair = self.pki.worker(c, "h0")
        kw.setdefault("retry_for", 20.0)
        return RelayClient(self.work[c], ca=self.pki.ca_cert, cert=pair.cert, key=pair.key,
                           job_id=self.cfg[c].job_id, cluster=c, round_timeout=5.0, **kw)


@contextmanager
def running(job: Job, names: list[str] | None = None) -> Iterator[dict[str, Relay]]:
    relays: dict[str, Relay] = {}
    try:
        for c in names or job.clusters:
            relays[c] = Relay(job.cfg[c])
            relays[c].start()
        yield relays
    finally:
        for r in relays.values():
            r.stop()


@contextmanager
def clients(job: Job, names: list[str] | None = None) -> Iterator[dict[str, RelayClient]]:
    made = {c: job.client(c) for c in names or job.clusters}
    try:
        yield made
    finally:
        for cl in made.values():
            cl.close()


def together(cls: dict[str, RelayClient], round_id: int, xs: dict[str, torch.Tensor],
             delays: dict[str, float] | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """Every client's allreduce(round_id, xs[c]) at the same time (optionally delayed)."""
    def call(c: str) -> Any:
        time.sleep((delays or {}).get(c, 0.0))
        return cls[c].allreduce(round_id, xs[c])

    with ThreadPoolExecutor(len(xs)) as pool:
        futs = {c: pool.submit(call, c) for c in xs}
        return {c: f.result(timeout=timeout) for c, f in futs.items()}


def exact_mean(xs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference: sum in sorted cluster order, then divide by the count (plain torch)."""
    names = sorted(xs)
    total = xs[names[0]].clone()
    for c in names[1:]:
        total = total + xs[c]
    return total / len(names)


def wait_until(pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def read_jsonl(path: str | None) -> list[dict[str, Any]]:
    assert path is not None
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def start_relay_process(cfg_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "nebula_cli.relay.process.server", "--config", str(cfg_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO)


DAY = datetime.timedelta(days=1)  # certificates for a test's lifetime


def free_ports(n: int) -> list[int]:
    """`n` different free loopback ports (see `sshd_bed.free_port`)."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)
