"""relay/protocol/fetch.py: an answer to a fetch is assembled from its header and its chunks,
within the size this relay syncs (a peer's catch-up over real links is in
tests/relay/process/test_server.py and test_relay_recovery.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from nebula_cli.relay.net.wire import WireError
from nebula_cli.relay.protocol.fetch import Fetch
from nebula_cli.relay.protocol.messages import (
    AnswerChunk,
    AnswerStatus,
    ResultAnswer,
    StateAnswer,
)


def payload(x: torch.Tensor) -> bytearray:
    return bytearray(x.numpy().tobytes())  # as a received frame carries it


def test_an_answer_is_its_header_then_its_chunks_in_order() -> None:
    fetch = Fetch(7, link=None, max_numel=10)  # type: ignore[arg-type]
    x = torch.arange(10, dtype=torch.float32)
    done = threading.Event()
    threading.Thread(target=lambda: fetch.wait(10) and done.set()).start()
    fetch.on_head(StateAnswer(req=7, status=AnswerStatus.OK, round=3, lineage="lin", parts=1,
                              numel=10))
    assert not fetch.complete
    fetch.on_chunk(AnswerChunk(req=7, lo=0, payload=payload(x[:6])))
    fetch.on_chunk(AnswerChunk(req=7, lo=6, payload=payload(x[6:])))
    assert done.wait(5) and fetch.complete and torch.equal(fetch.tensor, x)


def test_an_answer_without_a_tensor_is_complete_at_its_header() -> None:
    fetch = Fetch(1, link=None, max_numel=10)  # type: ignore[arg-type]
    fetch.on_head(ResultAnswer(req=1, status=AnswerStatus.NONE))
    assert fetch.complete and fetch.tensor is None and fetch.wait(0)


@pytest.mark.parametrize("steps, words", [
    ([ResultAnswer(req=1, status=AnswerStatus.OK, round=3, numel=11)], "declares 11 elements"),
    ([ResultAnswer(req=1, status=AnswerStatus.NONE), ResultAnswer(req=1, status=AnswerStatus.NONE)],
     "second answer"),
    ([AnswerChunk(req=1, lo=0, payload=bytes(8))], "unexpected chunk"),
    ([ResultAnswer(req=1, status=AnswerStatus.OK, round=3, numel=4), AnswerChunk(req=1, lo=2,
                                                                                 payload=bytes(8))],
     "unexpected chunk at 2"),
    ([ResultAnswer(req=1, status=AnswerStatus.OK, round=3, numel=4), AnswerChunk(req=1, lo=0,
                                                                                 payload=bytes(6))],
     "unexpected chunk"),
    ([ResultAnswer(req=1, status=AnswerStatus.OK, round=3, numel=1), AnswerChunk(req=1, lo=0,
                                                                                 payload=bytes(8))],
     "too much data"),
])
def test_an_answer_that_breaks_the_protocol_closes_the_link(steps: list, words: str) -> None:
    fetch = Fetch(1, link=None, max_numel=10)  # type: ignore[arg-type]
    with pytest.raises(WireError, match=words):
        for step in steps:
            (fetch.on_chunk if isinstance(step, AnswerChunk) else fetch.on_head)(step)


def test_a_failed_fetch_ends_its_wait() -> None:
    fetch = Fetch(1, link=None, max_numel=10)  # type: ignore[arg-type]
    threading.Timer(0.1, fetch.fail, ("link down",)).start()
    assert fetch.wait(10) is False and fetch.error == "link down"
