"""Relays that die, end and rejoin: a relay killed with SIGKILL left out and caught up, a small
model's catch-up in chunks peers accept, relays that end once every cluster has finished; the
duplex TLS link, a worker's HELLO and TCP keepalive. Helpers: helpers/relays.py."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.relays import (
    Job,
    clients,
    exact_mean,
    read_jsonl,
    running,
    start_relay_process,
    together,
    wait_until,
)

from nebula_cli.pki import client_context, server_context
from nebula_cli.relay.net.duplex import DuplexTLS
from nebula_cli.relay.process.client import RelayError

# ---------------------------------------------------------------------- a relay killed


def test_killed_relay_is_left_out_then_catches_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """a (a subprocess, the first cluster: coordinator and listener) stalls, then is SIGKILLed;
    b goes on alone after each deadline; a restarted a is redialled by b (backoff) and its
    client gets the global state b's worker published; then both average together again;
    SIGTERM ends the relay with exit code 0."""
    caplog.set_level(logging.INFO, logger="nebula")
    job = Job(tmp_path, ["a", "b"], round_timeout=2.0, heartbeat=0.5, dead_after=1.5)
    cfg_path = tmp_path / "relay-a.json"
    job.cfg["a"].dump(cfg_path)
    log_path = tmp_path / "relay-a.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start_relay_process(cfg_path, log_path))
        with running(job, ["b"]) as relays, clients(job) as cls:
            wait_until(lambda: relays["b"].connected() == ["a"], 20, "b to reach a")
            theta = torch.zeros(1500)
            for r in range(2):
                xs = {c: torch.randn(1500) for c in job.clusters}
                res = together(cls, r, xs)
                assert torch.equal(res["a"].tensor, exact_mean(xs))
                theta -= res["b"].tensor
                cls["b"].publish_state(r, theta)

            # a stalls (SIGSTOP): b hears nothing for dead_after (1.5 s) and drops the link; once a
            # runs again, b redials it
            procs[0].send_signal(signal.SIGSTOP)
            try:
                wait_until(lambda: relays["b"].connected() == [], 10, "b to drop a silent a")
            finally:
                procs[0].send_signal(signal.SIGCONT)
            wait_until(lambda: relays["b"].connected() == ["a"], 10, "b to redial a")
            assert "peer a disconnected (127.0.0.1:" in caplog.text
            assert "no traffic for 1.5s" in caplog.text

            # round 2: a's relay dies while b's round is waiting for it
            with ThreadPoolExecutor(1) as pool:
                fut = pool.submit(cls["b"].allreduce, 2, torch.randn(1500))
                time.sleep(0.3)
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait(10)
                res2 = fut.result(timeout=20)
            assert res2.present == ["b"] and res2.missing == ["a"]
            assert res2.seconds < 2.0  # as soon as a was gone, before the round's deadline
            theta -= res2.tensor
            cls["b"].publish_state(2, theta)
            res3 = cls["b"].allreduce(3, torch.randn(1500))
            assert res3.present == ["b"]
            theta -= res3.tensor
            momentum = torch.randn(1500)
            cls["b"].publish_state(3, theta, momentum)  # with its outer momentum

            # a comes back; its worker (still at round 2) catches up from b's state
            procs.append(start_relay_process(cfg_path, log_path))
            back = cls["a"].allreduce(2, torch.randn(1500))
            assert back.global_state is not None and back.round_id == 3
            assert torch.equal(back.global_state, theta)
            assert back.global_momentum is not None
            assert torch.equal(back.global_momentum, momentum)
            assert torch.equal(back.tensor, torch.zeros(1500))
            xs = {c: torch.randn(1500) for c in job.clusters}
            res4 = together(cls, 4, xs)
            assert res4["a"].present == ["a", "b"]
            assert torch.equal(res4["a"].tensor, res4["b"].tensor)
            assert torch.equal(res4["b"].tensor, exact_mean(xs))
            with pytest.raises(RelayError):
                cls["a"].allreduce(-1, torch.ones(2))

        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(15) == 0
        log = log_path.read_text()
        assert "caught up to round 3" in log
        b_lines = read_jsonl(job.cfg["b"].metrics_file)
        assert [m["missing"] for m in b_lines if m["round"] in (2, 3)] == [["a"], ["a"]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_a_small_model_catches_up_with_theta_and_momentum_in_chunks_peers_accept(
        tmp_path: Path) -> None:
    """A model smaller than a chunk (the default 1 M elements): a published state of two parts
    (theta, momentum) is twice the synced size, so it must travel in chunks of at most that
    size, or the catching-up peer closes the link ("exceeds the cap") and never catches up."""
    job = Job(tmp_path, ["a", "b"], round_timeout=1.0, heartbeat=0.5, chunk_numel=1 << 20)
    n = 20_000  # its state, 160 KB, is above any control frame (64 KiB)
    with running(job) as relays, clients(job) as cls:
        wait_until(lambda: relays["b"].connected() == ["a"], 20, "b to reach a")
        together(cls, 0, {c: torch.randn(n) for c in job.clusters})
        theta = torch.randn(n)
        for r in (1, 2):  # b alone (a's worker does not come)
            assert cls["b"].allreduce(r, torch.randn(n)).present == ["b"]
        momentum = torch.randn(n)
        cls["b"].publish_state(2, theta, momentum)
        back = cls["a"].allreduce(1, torch.randn(n))
        assert back.global_state is not None and back.round_id == 2
        assert torch.equal(back.global_state, theta)
        assert back.global_momentum is not None and torch.equal(back.global_momentum, momentum)
        assert relays["a"].connected() == ["b"]  # the link was never closed over it


def test_relays_end_once_every_cluster_has_finished(tmp_path: Path) -> None:
    """Nobody looks at the job: once every cluster's workers said goodbye, the relays end by
    themselves (after their linger), not while a cluster still trains."""
    job = Job(tmp_path, ["a", "b"], round_timeout=5.0, heartbeat=0.5)
    with running(job) as relays:
        for r in relays.values():
            r.linger = 0.5
        wait_until(lambda: relays["b"].connected() == ["a"], 20, "b to reach a")
        with clients(job, ["a"]) as ca, clients(job, ["b"]) as cb:
            together({**ca, **cb}, 0, {c: torch.randn(100) for c in job.clusters})
            ca["a"].close()  # a's workers are done; b's still train
            time.sleep(2.0)
            assert not relays["a"].ended.is_set() and not relays["b"].ended.is_set()
        wait_until(lambda: all(r.ended.is_set() for r in relays.values()), 20,
                   "both relays to end")


def test_duplex_tls_carries_both_directions_at_once(tmp_path: Path) -> None:
    """A reader and a writer thread on each end of one TLS connection, both ends sending 24 MB
    at once through 256 KiB socket buffers (the writers block): every byte arrives in order,
    nothing deadlocks."""
    job = Job(tmp_path, ["a", "b"])
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[Any] = []
    t = threading.Thread(target=lambda: accepted.append(server_context(
        job.pki.relay("a"), job.pki.ca_cert).wrap_socket(listener.accept()[0],
                                                         server_side=True)))
    t.start()
    raw = socket.create_connection(listener.getsockname())
    client = client_context(job.pki.relay("b"), job.pki.ca_cert).wrap_socket(
        raw, server_hostname="relay")
    t.join(10)
    listener.close()
    ends = [DuplexTLS(accepted[0]), DuplexTLS(client)]
    for end in ends:
        end.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 262144)
        end.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 262144)
    size = 24 * 2**20
    payloads = [os.urandom(size), os.urandom(size)]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            for off in range(0, size, 3_000_001):  # pieces that do not align with records
                ends[i].sendall(payloads[i][off:off + 3_000_001])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def read(i: int) -> None:
        h, n, buf = hashlib.sha256(), 0, bytearray(65536)
        try:
            while n < size:
                k = ends[i].recv_into(buf, min(len(buf), size - n))
                if k == 0:
                    raise ConnectionError("early end of stream")
                h.update(memoryview(buf)[:k])
                n += k
            got[i] = h.hexdigest()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=f, args=(i,)) for f in (write, read) for i in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    try:
        assert not errors, errors
        assert not any(th.is_alive() for th in threads), "a direction stalled"
        assert got == {0: hashlib.sha256(payloads[1]).hexdigest(),
                       1: hashlib.sha256(payloads[0]).hexdigest()}
    finally:
        for end in ends:
            end.sock.close()


def test_a_worker_states_what_it_syncs_at_hello(tmp_path: Path) -> None:
    from nebula_cli.runtime.sync import sync_layout

    job = Job(tmp_path, ["east", "west"])
    layout = sync_layout([torch.Size([2, 3]), torch.Size([4])])
    assert layout == {"shapes": [[2, 3], [4]], "dtypes": ["float32", "float32"]}
    with running(job) as relays, job.client("east", layout=layout, retry_for=2.0) as client:
        client._connect()  # the HELLO registers the size before any round
        sync = relays["east"].rounds.state.sync
        assert sync is not None and sync.numel == 10 and sync.tensors == 2
        with pytest.raises(RelayError, match="10"):
            client.allreduce(0, torch.zeros(11))
    many = sync_layout([torch.Size([3])] * 10_000)  # too long for a HELLO: one flat vector
    assert many == {"shapes": [[30_000]], "dtypes": ["float32"]}


def test_worker_connections_are_kept_alive_by_tcp() -> None:
    from nebula_cli.relay.net.limits import WORKER_KEEPALIVE_IDLE
    from nebula_cli.relay.process.worker_port import keep_alive

    with socket.socket() as s:
        keep_alive(s)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == WORKER_KEEPALIVE_IDLE
