"""relay/protocol/allreduce.py: a round's exchange holds what it has not averaged yet as it was
encoded, so this relay's own chunks, encoded faster than its peers' arrive, never add up to a
decoded copy of the vector; the average is the same bits as the exact mean of the decoded parts."""

from __future__ import annotations

import torch

from nebula_cli.relay.codecs.registry import get_codec
from nebula_cli.relay.protocol.allreduce import (
    ExchangeError,
    RoundExchange,
    Schedule,
    ordered_mean,
)


def test_own_chunks_wait_encoded_for_their_peer_parts_and_average_exactly() -> None:
    codec = get_codec("int8")
    decoded: list[int] = []

    def decode(enc: object) -> torch.Tensor:
        out = codec.decode(enc)
        decoded.append(out.numel())
        return out

    spans = [(lo, min(lo + 256, 1000)) for lo in range(0, 1000, 256)]
    ex = RoundExchange(Schedule("a", ("a", "b"), len(spans)), spans, encode=codec.encode,
                       decode=decode, send=lambda *_: None)
    gen = torch.Generator().manual_seed(3)
    own, peer = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    mine = [codec.encode(own[lo:hi]) for lo, hi in spans]
    theirs = [codec.encode(peer[lo:hi]) for lo, hi in spans]
    for k, enc in enumerate(mine):  # the whole contribution encoded before any peer chunk
        ex.add_own(k, enc)
    assert decoded == []  # nothing decoded while no chunk is complete: held as encoded
    assert all(parts["a"] is mine[k] for k, parts in ex._parts.items())
    for k, enc in enumerate(theirs):
        ex.add_contrib("b", k, enc)
        assert sorted(ex._parts) == list(range(k + 1, len(spans)))  # chunk k done, let go
    assert ex.wait(1.0)
    assert sum(decoded) == 2 * 1000  # each part decoded once, when its chunk completed
    want = torch.cat([ordered_mean({"a": codec.decode(m), "b": codec.decode(t)})
                      for m, t in zip(mine, theirs, strict=True)])
    assert torch.equal(ex.result, want)


def test_a_peer_chunk_of_the_wrong_length_fails_the_round_naming_its_sender() -> None:
    codec = get_codec("int8")
    spans = [(0, 100)]
    ex = RoundExchange(Schedule("a", ("a", "b"), 1), spans, encode=codec.encode,
                       decode=codec.decode, send=lambda *_: None)
    ex.add_own(0, codec.encode(torch.ones(100)))
    try:
        ex.add_contrib("b", 0, codec.encode(torch.ones(99)))  # one value short
    except ExchangeError as exc:
        said = str(exc)
    else:
        ex.wait(1.0)
        said = str(ex.error)
    assert "chunk 0 from b decodes to (99,)" in said, said
