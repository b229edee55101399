"""A teacher's serving rank (`relay.distill.serve_link`) under asks it cannot run, over real
TLS on loopback: the WELCOME carries the teacher's vocabulary and context, a student's client
refuses a batch beyond them naming both, an ask that bypasses it (a raw student) fails at the
relay before any server sees it, and an ask the model fails on fails alone (LABELS_FAILED to its
student): the serving rank lives on and answers the next ask, and nothing is asked again."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.jobs import wait_for
from helpers.label_teacher import (
    CONTEXT,
    JOB,
    VOCAB,
    answer,
    job_pki,
    label_client,
    label_relay,
    serve_link,
    serving,
    worker_ctx,
)

from nebula_cli.pki import wrap_client
from nebula_cli.relay.distill.idpack import bits_needed, pack_ids
from nebula_cli.relay.distill.label_client import AskRefused, LabelClient, LabelsFailed
from nebula_cli.relay.distill.label_relay import LabelRelay
from nebula_cli.relay.distill.messages import LabelAsk, LabelHello, Side
from nebula_cli.relay.distill.sparse import SparseLabels
from nebula_cli.relay.net.wire import FrameType, recv_frame, send_frame

POISON = 4242
"""A token the stand-in model fails on (as a model with a smaller embedding would)."""


def fragile(tokens: np.ndarray) -> SparseLabels:
    if (tokens == POISON).any():
        raise IndexError("index out of range in self")  # what torch's embedding raises
    return answer(tokens)


@pytest.fixture
def teacher(tmp_path: Path) -> Iterator[tuple[LabelRelay, LabelClient, Path]]:
    pki = job_pki(tmp_path / "pki")
    relay = label_relay(pki)
    client = label_client(pki, {"lab": f"127.0.0.1:{relay.port}"})
    try:
        yield relay, client, pki
    finally:
        client.close()
        relay.close()


def test_an_ask_the_model_fails_on_fails_alone_and_the_rank_serves_on(teacher) -> None:
    relay, client, pki = teacher
    link = serve_link(f"127.0.0.1:{relay.port}", pki, "lab", "t1", JOB, answer_with=fragile)
    with serving(link):
        assert client.wait_live(10)
        client.ask(0, np.array([[1, POISON, 3]]))
        client.ask(1, np.array([[1, 2, 3]]))
        with pytest.raises(LabelsFailed, match="IndexError: index out of range"):
            client.take(0, 20)
        got = client.take(1, 20)  # the same rank, alive, answered the next ask
        assert got is not None and got.vocab == VOCAB
        assert link.failed == 1 and link.answered == 1
    counts = relay.counts()
    assert counts.failed == 1 and counts.answers == 1 and counts.pending == 0
    assert client.outstanding() == 0 and client.resent == 0  # asked once, not again


def test_a_batch_beyond_the_teachers_vocabulary_or_context_is_refused_naming_both(
        teacher) -> None:
    relay, client, pki = teacher
    assert relay.welcome.vocab == VOCAB and relay.welcome.context == CONTEXT
    assert client.wait_live(10)
    with pytest.raises(AskRefused, match=f"token id {VOCAB} in sequences of 2; teacher lab's "
                                         f"vocabulary is {VOCAB} tokens and its context "
                                         f"{CONTEXT}"):
        client.ask(0, np.array([[1, VOCAB]]))
    with pytest.raises(AskRefused, match=f"in sequences of {CONTEXT + 1}"):
        client.ask(0, np.zeros((1, CONTEXT + 1), dtype=np.int64))
    assert client.outstanding() == 0


def test_an_ask_past_the_vocabulary_fails_at_the_relay_before_any_server(teacher) -> None:
    relay, _, pki = teacher
    with serving(serve_link(f"127.0.0.1:{relay.port}", pki, "lab", "t1", JOB)) as link:
        assert wait_for(lambda: relay.counts().servers == 1)
        raw = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
        tls, _ = wrap_client(raw, worker_ctx(pki, "cloud", "s2"), job_id=JOB, roles={"relay"})
        with contextlib.closing(tls):
            tls.settimeout(5)
            send_frame(tls, LabelHello(job=JOB, side=Side.STUDENT, rank=1).to_frame())
            assert recv_frame(tls).type is FrameType.WELCOME
            ids = np.array([7, VOCAB + 9])
            bits = bits_needed(ids)
            send_frame(tls, LabelAsk(seq=5, tokens=2, width=2, bits=bits).to_frame(
                pack_ids(ids, bits)))
            got = recv_frame(tls)
        assert got.type is FrameType.LABELS_FAILED and got.meta["seq"] == 5
        assert f"token id {VOCAB + 9}; the teacher's vocabulary is {VOCAB}" in got.meta["reason"]
        assert link.answered == link.failed == 0  # no server saw it
    assert relay.counts().failed == 1 and relay.counts().answers == 0
