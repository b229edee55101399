"""What a student may hold at a label relay (`relay.distill.student_links`), over real TLS on
loopback: one that asks past the asks a link may have outstanding is ended with a refusal
naming the bound (nothing past it is queued); an ask past the queue's tokens fails at once; a
cluster holds at most its slots plus one links, a rank's new link replacing its older one, and
one more link is refused saying why."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import numpy as np
import pytest
from helpers.jobs import wait_for
from helpers.label_teacher import JOB, STUDENT_SLOTS, job_pki, label_relay, worker_ctx

from nebula_cli.pki import wrap_client
from nebula_cli.relay.distill.dial import RelayRefused, dial
from nebula_cli.relay.distill.idpack import pack_ids
from nebula_cli.relay.distill.messages import LabelAsk, LabelHello, Side
from nebula_cli.relay.net.wire import FrameType, WireError, recv_frame, send_frame


@pytest.fixture
def relay(tmp_path: Path):
    pki = job_pki(tmp_path / "pki")
    made = label_relay(pki, dead_after=30.0)  # the links here send no heartbeats
    made.pki = pki  # type: ignore[attr-defined]
    yield made
    made.close()


def test_a_link_past_its_asks_is_ended_with_the_bound_named(relay) -> None:
    raw = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
    tls, _ = wrap_client(raw, worker_ctx(relay.pki, "cloud", "s1"), job_id=JOB, roles={"relay"})
    held = relay.welcome.max_asks
    with contextlib.closing(tls):
        tls.settimeout(5)
        send_frame(tls, LabelHello(job=JOB, side=Side.STUDENT).to_frame())
        assert recv_frame(tls).meta["max_asks"] == held
        for seq in range(held + 50):  # no server: an unbounded relay queues them all
            send_frame(tls, LabelAsk(seq=seq, tokens=8, width=8,
                                     bits=4).to_frame(pack_ids(np.arange(8), 4)))
        got = recv_frame(tls)
    assert got.type is FrameType.ERROR
    assert got.meta["reason"].startswith(f"more than {held} asks outstanding on one link")
    assert wait_for(lambda: relay.counts().students == 0)
    assert relay.counts().asks == held and relay.counts().pending == 0  # dropped with it


def test_an_ask_past_the_queues_tokens_fails_at_once(tmp_path: Path) -> None:
    pki = job_pki(tmp_path / "pki")
    relay = label_relay(pki, dead_after=30.0, queue_tokens=20)
    raw = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
    tls, _ = wrap_client(raw, worker_ctx(pki, "cloud", "s1"), job_id=JOB, roles={"relay"})
    try:
        tls.settimeout(5)
        send_frame(tls, LabelHello(job=JOB, side=Side.STUDENT).to_frame())
        assert recv_frame(tls).type is FrameType.WELCOME
        for seq in range(3):  # 8 tokens each, no server: the third would make 24 > 20
            send_frame(tls, LabelAsk(seq=seq, tokens=8, width=8,
                                     bits=4).to_frame(pack_ids(np.arange(8), 4)))
        got = recv_frame(tls)
        assert got.type is FrameType.LABELS_FAILED and got.meta["seq"] == 2
        assert got.meta["reason"] == "the teacher's queue is full (16 tokens waiting, 20 at most)"
        assert relay.counts().pending == 2 and relay.counts().failed == 1
    finally:
        tls.close()
        relay.close()


def test_a_cluster_holds_its_slots_plus_one_links_a_ranks_new_one_replacing_its_old(
        relay) -> None:
    ctx = worker_ctx(relay.pki, "cloud", "s1")

    def link(rank: int):
        return dial(f"127.0.0.1:{relay.port}", ctx, hello=LabelHello(
            job=JOB, side=Side.STUDENT, rank=rank), cluster="lab", max_payload=1 << 20,
            timeout=5.0)[0]

    cap = STUDENT_SLOTS["cloud"] + 1
    links = [link(rank) for rank in range(cap)]
    try:
        assert wait_for(lambda: relay.counts().students == cap)
        with pytest.raises(RelayRefused, match=f"cluster cloud holds {cap} links to this label "
                                               "relay already"):
            link(cap)
        again = link(0)  # rank 0 dialled again: its old link is ended, the new one kept
        links.append(again)
        with pytest.raises(WireError):
            while True:
                links[0].recv()  # the relay ended rank 0's old link
        assert relay.counts().students == cap and not again.closed.is_set()
        assert relay.counts().refused == 1
    finally:
        for one in links:
            one.close()
