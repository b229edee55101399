"""A student's `LabelClient` (`relay.distill.label_client`), before any link: an ask's ids must
fit in 24 bits (a negative or too large id is refused, named, and nothing is asked), and its
size in tokens is bounded. Asks answered over real links: `test_label_relay`."""

from __future__ import annotations

import ssl

import numpy as np
import pytest

from nebula_cli.relay.distill.label_client import LabelClient
from nebula_cli.relay.net.wire import WireError


def client() -> LabelClient:
    return LabelClient({"lab": "127.0.0.1:1"}, ssl.create_default_context(), job_id="j",
                       max_tokens=8, topk=4, dead_after=1.0)  # not started: no link


@pytest.mark.parametrize("ids, says", [
    (np.array([[3, -2]]), "token id -2 is negative; ids are 0..16777215"),
    (np.array([[1 << 24, 0]]), "token id 16777216 does not fit in 24 bits"),
])
def test_an_id_outside_24_bits_is_refused_by_the_asker(ids: np.ndarray, says: str) -> None:
    c = client()
    with pytest.raises(WireError, match=says):
        c.ask(0, ids)
    assert c.outstanding() == 0
    c.ask(0, np.array([[3, (1 << 24) - 1]]))  # the largest id there is
    assert c.outstanding() == 1


def test_an_ask_of_more_tokens_than_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="an ask of 9 tokens; distill.max_tokens is 8"):
        client().ask(0, np.zeros(9, dtype=np.int64))
