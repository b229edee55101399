"""relay/codecs/feedback.py: what one codec left out goes into the next round's input, also
when the round's codec changes (``compression: auto``), and a refused encoding keeps the
residual as it was."""

from __future__ import annotations

import math

import pytest
import torch

from nebula_cli.codecs.topk.params import TopKParams
from nebula_cli.relay.codecs.base import CodecError
from nebula_cli.relay.codecs.feedback import ErrorFeedback
from nebula_cli.relay.codecs.registry import get_codec


def test_the_residual_is_what_the_encoding_lost_and_carries_across_codecs() -> None:
    topk, none = get_codec("topk"), get_codec("none")
    ef = ErrorFeedback(topk)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    sent = topk.decode(ef.encode(x, "k"))
    residual = ef.residual("k")
    assert residual is not None and torch.equal(residual, x - sent)
    assert int(torch.count_nonzero(sent)) == 4096 // 16  # one of each span of 16
    # the next round with an exact codec sends the new input and everything topk left out
    y = torch.randn(4096, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(none.decode(ef.encode(y, "k", none)), y + residual)
    assert not ef.residual("k").any()  # type: ignore[union-attr]


def test_a_refused_encoding_leaves_the_residual_as_it_was() -> None:
    fp16 = get_codec("fp16")
    ef = ErrorFeedback(fp16)
    ef.encode(torch.full((8,), 1.0 + 2.0**-12), "k")
    kept = ef.residual("k")
    assert kept is not None and kept.abs().max() > 0
    with pytest.raises(CodecError, match="beyond the codec's range"):
        ef.encode(torch.full((8,), 1e6), "k")
    with pytest.raises(CodecError, match="NaN or infinite"):
        ef.encode(torch.full((8,), math.nan), "k")
    assert torch.equal(ef.residual("k"), kept)  # type: ignore[arg-type]


def test_a_decay_fades_what_stays_unsent_and_1_keeps_all_of_it() -> None:
    """With decay beta the input is x + beta * residual: a part topk never sends fades by beta
    a round (SparseLoCo's outer step), where beta 1 carries it whole; the decoded sum then lags
    the inputs' by the decayed residual, not by the whole debt."""
    codec = get_codec("topk", density=1 / 16, bits=8)
    x = torch.zeros(16)
    x[0], x[1] = 1.0, 0.01  # the small one is never the span's largest: never sent
    for beta in (1.0, 0.9, 0.5):
        ef = ErrorFeedback(codec, beta)
        for _ in range(20):
            ef.encode(x, "delta")
        residual = ef.residual("delta")
        assert residual is not None
        kept = sum(beta ** n for n in range(20)) * 0.01  # 0.01 each round, faded by beta
        assert residual[1].item() == pytest.approx(kept, rel=1e-5)
        assert residual[0].abs().item() < 1e-2  # the large one is sent every round
    assert ErrorFeedback(codec).decay() == TopKParams.feedback_decay == 0.7  # topk's own
    assert ErrorFeedback(get_codec("int8")).decay() == 1.0


def test_a_decay_per_codec_follows_the_rounds_codec() -> None:
    """With compression: auto a round's codec names its beta; a codec not named takes its
    own."""
    int8, topk = get_codec("int8"), get_codec("topk", density=1 / 16, bits=8)
    ef = ErrorFeedback(int8, {"topk": 0.5})
    assert (ef.decay(), ef.decay(topk)) == (1.0, 0.5)
    assert ErrorFeedback(int8, {"int8": 0.9}).decay(topk) == TopKParams.feedback_decay
    x = torch.zeros(16)
    x[0], x[1] = 1.0, 0.01
    ef.encode(x, "d", topk)
    ef.encode(x, "d", topk)  # the second round's input: x + 0.5 * (the 0.01 left out)
    residual = ef.residual("d")
    assert residual is not None and residual[1].item() == pytest.approx(0.015, rel=1e-5)
    with pytest.raises(CodecError, match="decay must be in"):
        ErrorFeedback(int8, {"topk": 0.0})


@pytest.mark.parametrize("beta", [0.0, -0.5, 1.5, math.nan])
def test_a_decay_outside_0_1_is_refused(beta: float) -> None:
    with pytest.raises(CodecError, match=r"decay must be in \(0, 1\]"):
        ErrorFeedback(get_codec("int8"), beta)
