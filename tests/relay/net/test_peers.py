"""A relay's peer and worker ports under a crowd of unauthenticated connections (the accept
path: nebula_cli.relay.net.peers.Listener with nebula_cli.relay.net.admission): a hostile
client on eight addresses keeps idle connections open on both ports (reopening every one the
relay ends), yet the other cluster's relay links up, a worker connects, and a round averages;
a silent connection is ended at the first-bytes deadline, a client that trickles its TLS
handshake at the handshake deadline.

Real relays in this process, real mutual TLS with a job PKI issued in tmp_path, a real
RelayClient. REALWORLD rows: relays reachable from the internet; links that drop and come
back (a peer must be able to reconnect while its port is crowded)."""

from __future__ import annotations

import dataclasses
import datetime
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from helpers.crowd import Crowd
from helpers.plan_defaults import relay_defaults
from helpers.slow_link import SlowLink
from helpers.sshd_bed import free_port
from helpers.tls_handshake import client_hello

from nebula_cli.config.codec_params import params_from_knobs
from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.pki import JobPKI, issue_job_pki
from nebula_cli.relay.net.admission import FIRST_BYTES_TIMEOUT
from nebula_cli.relay.net.limits import HANDSHAKE_TIMEOUT
from nebula_cli.relay.process.client import RelayClient
from nebula_cli.relay.process.server import Relay

JOB = "job-crowded"
CLUSTERS = ["a", "b"]


class TwoClusters:
    """The PKI and relay configs of a two-cluster job on loopback."""

    def __init__(self, tmp: Path) -> None:
        self.pki: JobPKI = issue_job_pki(JOB, {c: ["h0"] for c in CLUSTERS}, tmp / "pki",
                                         valid_for=datetime.timedelta(days=1))
        self.peer = {c: ("127.0.0.1", free_port()) for c in CLUSTERS}
        self.work = {c: ("127.0.0.1", free_port()) for c in CLUSTERS}
        self.cfg = {}
        for c in CLUSTERS:
            pair = self.pki.relay(c)
            opts = relay_defaults(codec="none", error_feedback=False, round_timeout=20.0,
                                  heartbeat=1.0, chunk_numel=1024)
            self.cfg[c] = RelayConfig(
                job_id=JOB, cluster=c, clusters=CLUSTERS, peer_listen=addr(self.peer[c]),
                worker_listen=addr(self.work[c]),
                peers={o: addr(self.peer[o]) for o in CLUSTERS if o != c},
                tls={"ca": str(self.pki.ca_cert), "cert": str(pair.cert), "key": str(pair.key)},
                status_file=str(tmp / f"status-{c}.json"),
                metrics_file=str(tmp / f"metrics-{c}.jsonl"), **opts)

    def client(self, c: str) -> RelayClient:
        pair = self.pki.worker(c, "h0")
        return RelayClient(addr(self.work[c]), ca=self.pki.ca_cert, cert=pair.cert,
                           key=pair.key, job_id=JOB, cluster=c, round_timeout=20.0,
                           retry_for=20.0)


def addr(where: tuple[str, int]) -> str:
    return f"{where[0]}:{where[1]}"


@pytest.fixture
def job(tmp_path: Path) -> TwoClusters:
    return TwoClusters(tmp_path)


@pytest.fixture
def relay_a(job: TwoClusters) -> Iterator[Relay]:
    relay = Relay(job.cfg["a"])  # a is dialled by b (the later cluster dials)
    relay.start()
    yield relay
    relay.stop()


def wait_until(pred: object, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():  # type: ignore[operator]
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_peer_and_a_worker_get_in_while_a_crowd_holds_idle_connections(
        job: TwoClusters, relay_a: Relay) -> None:
    with ExitStack() as stack:
        crowds = [stack.enter_context(Crowd(job.peer["a"], addresses=8, per_address=6)),
                  stack.enter_context(Crowd(job.work["a"], addresses=8, per_address=6))]
        for crowd in crowds:
            crowd.wait_full()
        relay_b = Relay(job.cfg["b"])
        relay_b.start()
        stack.callback(relay_b.stop)
        took = wait_until(lambda: relay_a.connected() == ["b"], 8.0,
                          "b's relay to link up with a through the crowd")
        clients = {c: stack.enter_context(job.client(c)) for c in CLUSTERS}
        xs = {c: torch.randn(4096) for c in CLUSTERS}
        with ThreadPoolExecutor(2) as pool:
            futures = {c: pool.submit(clients[c].allreduce, 0, xs[c]) for c in CLUSTERS}
            results = {c: f.result(timeout=60) for c, f in futures.items()}
        assert results["a"].present == ["a", "b"], results["a"]
        assert torch.equal(results["a"].tensor, results["b"].tensor)
        assert torch.allclose(results["a"].tensor, (xs["a"] + xs["b"]) / 2)
        assert all(crowd.ended > 0 for crowd in crowds)  # the crowd kept pushing
        print(f"b linked after {took:.2f}s; the crowd reopened "
              f"{[crowd.ended for crowd in crowds]} connections")


def test_a_peer_links_up_while_a_crowd_holds_one_idle_connection_from_each_of_40_addresses(
        job: TwoClusters, relay_a: Relay) -> None:
    """The review's case: more loopback addresses (free to any local user) than the port has
    slots, each holding one silent connection and reopening it when ended. Loopback counts as
    one client, and a handshake whose ClientHello has arrived is never ended for a silent
    connection: b's relay links up (before: every one of its handshakes was evicted). b is
    300 ms away each way (a proxy that holds each chunk), so its handshake takes seconds, as
    over a WAN, while the crowd reopens what the relay ends."""
    with ExitStack() as stack:
        crowd = stack.enter_context(Crowd(job.peer["a"], addresses=40, per_address=1))
        crowd.wait_full()
        far = stack.enter_context(SlowLink(job.peer["a"], delay=0.3))
        relay_b = Relay(dataclasses.replace(job.cfg["b"], peers={"a": f"127.0.0.1:{far.port}"}))
        relay_b.start()
        stack.callback(relay_b.stop)
        took = wait_until(lambda: relay_a.connected() == ["b"], 30.0,
                          "b's relay to link up with a through the crowd")
        assert crowd.ended > 0  # the crowd was there, and crowded out only itself
        print(f"b linked after {took:.2f}s; the crowd reopened {crowd.ended} connections")


def test_a_peer_links_up_while_a_crowd_on_its_network_speaks_and_stalls_on_every_slot(
        job: TwoClusters, relay_a: Relay) -> None:
    """Every slot of a's peer port held by loopback connections that sent the start of a
    ClientHello and stall (any local user can; where the job's peers come from loopback too,
    a local job or an SSH tunnel's end, they are counted as its peers are). b's ClientHello
    names the job (`pki.admission_name`): b links up well before the crowd's deadline. Before,
    every slot had spoken, all of it in b's network, and b's connections were refused until
    the crowd's handshakes ran out (HANDSHAKE_TIMEOUT), to be taken again at once."""
    stall = client_hello(None)[:120]
    with ExitStack() as stack:
        crowd = stack.enter_context(Crowd(job.peer["a"], addresses=8, per_address=4,
                                          first=stall))
        crowd.wait_full()
        time.sleep(0.3)  # every slot spoke
        relay_b = Relay(job.cfg["b"])
        relay_b.start()
        stack.callback(relay_b.stop)
        took = wait_until(lambda: relay_a.connected() == ["b"], HANDSHAKE_TIMEOUT * 0.6,
                          "b's relay to link up with a through the speaking crowd")
        assert crowd.ended > 0
        print(f"b linked after {took:.2f}s; the crowd reopened {crowd.ended} connections")


def held_for(where: tuple[str, int], first: bytes, trickle: bool) -> float:
    """Seconds until the relay ends a connection that sends `first`, then one byte a second
    (`trickle`) or nothing."""
    with socket.create_connection(where, timeout=2) as sock:
        sock.sendall(first)
        t0 = time.monotonic()
        sock.settimeout(1.0)
        while time.monotonic() - t0 < 3 * HANDSHAKE_TIMEOUT:
            try:
                if trickle:
                    sock.sendall(b"\x01")
                if sock.recv(1) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break
        return time.monotonic() - t0


def test_a_silent_connection_and_a_trickled_handshake_are_ended_in_time(
        job: TwoClusters, relay_a: Relay) -> None:
    """Nothing within FIRST_BYTES_TIMEOUT: ended then. A TLS record header announcing a
    512-byte ClientHello, then one byte a second: ended at HANDSHAKE_TIMEOUT."""
    with ThreadPoolExecutor(2) as pool:
        silent = pool.submit(held_for, job.peer["a"], b"", False)
        trickled = pool.submit(held_for, job.peer["a"], b"\x16\x03\x01\x02\x00", True)
        silent_s, trickled_s = silent.result(timeout=60), trickled.result(timeout=60)
    assert FIRST_BYTES_TIMEOUT - 1 < silent_s < FIRST_BYTES_TIMEOUT + 2, silent_s
    assert HANDSHAKE_TIMEOUT - 1 < trickled_s < HANDSHAKE_TIMEOUT + 3, trickled_s


def test_a_relay_whose_cluster_leaves_departs_and_a_stopped_or_lost_one_does_not(
        job: TwoClusters, relay_a: Relay) -> None:
    """A relay that leaves the job for good (nebula dropped its cluster) says so in its
    goodbye: its peers do not wait for it at the end. A link that just goes (a cut, a crash)
    and a relay that is only stopped (it may come back: a host shutting down, a scheduler's
    notice) are no departure; a relay that comes back is no longer departed."""
    b = Relay(job.cfg["b"])
    b.start()
    try:
        wait_until(lambda: relay_a.connected() == ["b"], 20, "b to reach a")
        link = relay_a.peers.link("b")
        assert link is not None and relay_a.peers.departed() == frozenset()
        b.peers.link("a").close("cut")  # type: ignore[union-attr]  # gone without a goodbye
        wait_until(lambda: link.closed, 10, "a to see the link go")
        assert not link.left_job and "b" not in relay_a.peers.departed()
        wait_until(lambda: relay_a.connected() == ["b"], 20, "b to dial again")
    finally:
        b.stop()  # stopped: may come back
    wait_until(lambda: relay_a.connected() == [], 10, "a to see b go")
    assert relay_a.peers.departed() == frozenset()
    back = Relay(job.cfg["b"])
    back.start()
    try:
        wait_until(lambda: relay_a.connected() == ["b"], 20, "b to come back")
        back.leaving = True  # as on LEAVE_SIGNAL
    finally:
        back.stop()
    wait_until(lambda: relay_a.connected() == [], 10, "a to see b leave")
    assert relay_a.peers.departed() == frozenset({"b"})
    again = Relay(job.cfg["b"])
    again.start()
    try:
        wait_until(lambda: relay_a.connected() == ["b"], 20, "b to come back once more")
        assert relay_a.peers.departed() == frozenset()
    finally:
        again.stop()


@pytest.mark.parametrize("knobs", [{"span": 4096}, {"bits": 1}])
def test_relays_whose_codec_knobs_differ_never_link_and_say_which(
        job: TwoClusters, relay_a: Relay, knobs: dict[str, int],
        caplog: pytest.LogCaptureFixture) -> None:
    """Every codec knob is in the HELLO (a topk span or width read differently by two relays
    would decode garbage): a peer whose knobs differ is refused, the knob named."""
    other = dataclasses.replace(job.cfg["b"], codec_params=params_from_knobs(knobs))
    relay_b = Relay(other)
    relay_b.start()
    try:
        (key, value), = knobs.items()
        wait_until(lambda: any(f"{key} {value!r} differs" in r.getMessage()
                               for r in caplog.records), 10.0, "a's refusal naming the knob")
        assert relay_a.connected() == [] and relay_b.connected() == []
    finally:
        relay_b.stop()
