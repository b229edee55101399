"""The soft-label service with real label relays, serving links and clients on loopback under
the job's mutual TLS: answers arrive whole and once, only students are answered and only the
teacher's workers serve, sizes are bounded, and a teacher killed by SIGKILL (a serving process,
or a whole label relay) costs the student nothing but the time to ask another."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.jobs import wait_for
from helpers.label_teacher import (
    JOB,
    K,
    answer,
    job_pki,
    label_client,
    label_relay,
    serve_link,
    serving,
    worker_ctx,
)

from nebula_cli.pki import wrap_client
from nebula_cli.relay.distill.dial import LabelRefused, dial
from nebula_cli.relay.distill.idpack import pack_ids
from nebula_cli.relay.distill.label_client import LabelClient
from nebula_cli.relay.distill.label_relay import LabelRelay
from nebula_cli.relay.distill.messages import LabelAsk, LabelHello, Side
from nebula_cli.relay.net.wire import FrameType, WireError, recv_frame, send_frame

TESTS = Path(__file__).resolve().parents[2]


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    return job_pki(tmp_path / "pki")


@pytest.fixture
def closing() -> Iterator[list[LabelRelay | LabelClient]]:
    made: list[LabelRelay | LabelClient] = []
    yield made
    for thing in reversed(made):
        thing.close()


def addr(relay: LabelRelay) -> str:
    return f"127.0.0.1:{relay.port}"


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 5000, size=n).astype(np.uint32)


def ask_bytes(toks: np.ndarray) -> int:
    """An ask's payload: its ids in the bits of the largest (4 bytes a token in protocol 1)."""
    return (len(toks) * int(toks.max()).bit_length() + 7) // 8


def check(client: LabelClient, seq: int, toks: np.ndarray, timeout: float = 20.0) -> str:
    got = client.take(seq, timeout)
    assert got is not None, f"no answer to ask {seq}"
    want = answer(toks.astype(np.int64))
    assert np.array_equal(got.labels.ids, want.ids)
    assert np.allclose(got.labels.logp, want.logp, atol=1e-3)
    assert got.wire_bytes == len(toks) * K * (13 + 16) // 8 + (1 if len(toks) * K * 13 % 8 else 0)
    assert got.ask_bytes == ask_bytes(toks)
    return got.teacher


def test_a_students_asks_are_answered_by_the_teachers_servers(pki: Path, closing: list) -> None:
    relay = label_relay(pki)
    closing.append(relay)
    client = label_client(pki, {"lab": addr(relay)})
    closing.append(client)
    asks = {seq: tokens(50 + seq, seq) for seq in range(12)}
    asks[12] = np.arange(40, dtype=np.uint32) % 3  # ids 0..2: 2 bits a token, 10 bytes
    first = time.monotonic()
    for seq, toks in asks.items():  # asked before any server: they wait at the relay
        client.ask(seq, toks)
    held = relay.welcome.max_asks  # what a link may hold: the rest wait at the student
    assert held < 13 and wait_for(lambda: relay.counts().pending == held)  # the queue
    time.sleep(0.3)
    with serving(serve_link(addr(relay), pki, "lab", "t1", JOB)), \
            serving(serve_link(addr(relay), pki, "lab", "t2", JOB)):
        assert {check(client, seq, toks) for seq, toks in asks.items()} == {"lab"}
    counts = relay.counts()
    assert counts.asks == counts.answers == 13 and counts.pending == 0
    assert counts.tokens == sum(len(t) for t in asks.values())
    # what the students' asks took on the wire: their ids packed (13 bits at ids < 5000)
    assert counts.ask_bytes == sum(ask_bytes(t) for t in asks.values())
    assert ask_bytes(asks[12]) == 10 and ask_bytes(asks[0]) == (50 * 13 + 7) // 8
    # every answer's latency counts from its ask's arrival, the wait for a server included
    assert held * 0.3 <= counts.latency_s <= 13 * (time.monotonic() - first)
    assert client.outstanding() == 0 and client.answered == 13
    with pytest.raises(ValueError, match="distill.max_tokens is 1024"):
        client.ask(99, tokens(1025, 0))


@pytest.mark.parametrize("cluster, host, side, says", [
    ("other", "o1", Side.STUDENT, "cluster other is not a student of this job"),
    ("cloud", "s1", Side.SERVER, "only lab's workers serve its soft labels"),
    ("lab2", "u1", Side.SERVER, "only lab's workers serve its soft labels"),
])
def test_only_students_are_answered_and_only_the_teachers_workers_serve(
        pki: Path, closing: list, cluster: str, host: str, side: Side, says: str) -> None:
    relay = label_relay(pki)
    closing.append(relay)
    with pytest.raises(LabelRefused, match=says):
        dial(addr(relay), worker_ctx(pki, cluster, host), hello=LabelHello(job=JOB, side=side),
             cluster="lab", max_payload=1 << 20, timeout=5.0)
    assert wait_for(lambda: relay.counts().refused == 1)
    with pytest.raises(LabelRefused, match="certificate of cluster lab, expected lab2"):
        dial(addr(relay), worker_ctx(pki, "cloud", "s1"),
             hello=LabelHello(job=JOB, side=Side.STUDENT), cluster="lab2",
             max_payload=1 << 20, timeout=5.0)


def test_an_ask_over_the_bound_ends_the_link(pki: Path, closing: list) -> None:
    relay = label_relay(pki, max_tokens=16)
    closing.append(relay)
    raw = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
    tls, _ = wrap_client(raw, worker_ctx(pki, "cloud", "s1"), job_id=JOB, roles={"relay"})
    with contextlib.closing(tls):
        send_frame(tls, LabelHello(job=JOB, side=Side.STUDENT).to_frame())
        assert recv_frame(tls).type is FrameType.WELCOME
        send_frame(tls, LabelAsk(seq=0, tokens=17, width=17,
                                 bits=11).to_frame(pack_ids(np.arange(17), 11)))  # > 16
        with pytest.raises(WireError):
            tls.settimeout(5)
            recv_frame(tls)  # the relay ended the link (closed, no answer)
    assert wait_for(lambda: relay.counts().students == 0) and relay.counts().asks == 0


def test_a_student_of_protocol_1_is_refused_naming_both(pki: Path, closing: list) -> None:
    relay = label_relay(pki)
    closing.append(relay)
    raw = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
    tls, _ = wrap_client(raw, worker_ctx(pki, "cloud", "s1"), job_id=JOB, roles={"relay"})
    with contextlib.closing(tls):
        send_frame(tls, LabelHello(job=JOB, side=Side.STUDENT, protocol=1).to_frame())  # 4-byte ids
        tls.settimeout(5)
        got = recv_frame(tls)
    assert got.type is FrameType.ERROR
    assert got.meta["reason"] == "soft-label protocol 1; this relay speaks 3"


def spawn_teacher(relay: LabelRelay, pki: Path, host: str, delay: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "helpers.label_teacher", addr(relay),
                             str(pki), "lab", host, JOB, str(delay)], env=env)


def test_a_serving_process_killed_by_sigkill_loses_no_ask(pki: Path, closing: list) -> None:
    relay = label_relay(pki)
    closing.append(relay)
    client = label_client(pki, {"lab": addr(relay)})
    closing.append(client)
    doomed = spawn_teacher(relay, pki, "t1", delay=0.05)
    try:
        wait_for(lambda: relay.counts().servers == 1)
        asks = {seq: tokens(40, seq) for seq in range(30)}
        for seq, toks in asks.items():
            client.ask(seq, toks)
        wait_for(lambda: client.answered >= 3)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
        assert client.answered < 30  # killed mid-run
        with serving(serve_link(addr(relay), pki, "lab", "t2", JOB)):
            for seq, toks in asks.items():
                check(client, seq, toks)
    finally:
        doomed.kill()
        doomed.wait()
    counts = relay.counts()
    assert counts.asks == 30 and counts.answers >= 30 - 4  # at most its window was lost
    assert client.answered == 30 and client.outstanding() == 0


def test_a_teacher_replica_lost_whole_its_asks_go_to_the_other(pki: Path, closing: list) -> None:
    first, second = label_relay(pki, "lab"), label_relay(pki, "lab2")
    closing += [first, second]
    client = label_client(pki, {"lab": addr(first), "lab2": addr(second)})
    closing.append(client)
    with serving(serve_link(addr(first), pki, "lab", "t1", JOB, delay_s=0.05)), \
            serving(serve_link(addr(second), pki, "lab2", "u1", JOB, delay_s=0.05)):
        wait_for(lambda: client.live() == ["lab", "lab2"])
        asks = {seq: tokens(30, seq) for seq in range(40)}
        for seq, toks in asks.items():
            client.ask(seq, toks)
        wait_for(lambda: client.answered >= 4)
        first.close()  # the whole label relay of lab goes
        teachers = [check(client, seq, toks) for seq, toks in asks.items()]
        assert set(teachers) == {"lab", "lab2"}  # both shared the load before
        assert teachers[-1] == "lab2" and client.live() == ["lab2"]
        assert client.resent > 0
