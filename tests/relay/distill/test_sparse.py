"""Sparse soft labels on the wire (`relay.distill.sparse`): ids in as few bits as the
vocabulary needs, values in fp16 or 8 bits, exact sizes, malformed payloads refused."""

from __future__ import annotations

import numpy as np
import pytest

from nebula_cli.relay.distill.sparse import (
    SparseLabels,
    Values,
    decode,
    encode,
    from_draws,
    id_bits,
    next_tokens,
    payload_nbytes,
    to_draws,
)
from nebula_cli.relay.net.wire import WireError


def labels(rows: int, k: int, vocab: int, seed: int = 0) -> SparseLabels:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(rows)])
    logp = -np.sort(rng.exponential(2.0, size=(rows, k)).astype(np.float32), axis=1)
    return SparseLabels(ids.astype(np.int64), logp)


def test_ids_take_the_fewest_bits_that_hold_the_vocabulary() -> None:
    assert [id_bits(v) for v in (2, 256, 257, 4096, 50257, 1 << 24)] == [1, 8, 9, 12, 16, 24]
    with pytest.raises(WireError, match="vocabulary"):
        id_bits(1)


@pytest.mark.parametrize("vocab", [257, 4096, 50257])
def test_round_trip_ids_exact_and_values_within_their_encodings_error(vocab: int) -> None:
    src = labels(37, 32, vocab)
    for values, bound in ((Values.FP16, 2e-3), (Values.INT8, None)):
        data = encode(src, vocab, values)
        assert len(data) == payload_nbytes(37, 32, vocab, values)
        out = decode(data, 37, 32, vocab, values)
        assert np.array_equal(out.ids, src.ids)
        span = src.logp.max(axis=1, keepdims=True) - src.logp.min(axis=1, keepdims=True)
        err = np.abs(out.logp - src.logp)
        limit = bound * np.abs(src.logp).max() if bound else span / 255 / 2 + 2e-2 * span
        assert (err <= limit + 1e-6).all(), (values, float(err.max()))


def test_bytes_per_token_against_full_fp32_logits() -> None:
    vocab, k = 4096, 32
    fp16, int8, draws = (payload_nbytes(1000, k, vocab, v) / 1000
                         for v in (Values.FP16, Values.INT8, Values.DRAWS))
    assert fp16 == k * 12 / 8 + k * 2 == 112  # 12-bit ids, 2-byte values
    assert int8 == k * 12 / 8 + k + 4 == 84
    assert draws == k * 12 / 8 == 48  # ids only
    assert vocab * 4 / fp16 > 100 and vocab * 4 / int8 > 150 and vocab * 4 / draws > 300


def test_draws_cross_as_their_ids_and_come_back_as_their_frequencies() -> None:
    draws = np.array([[5, 3, 5, 7], [1, 1, 1, 1], [9, 8, 7, 6], [2, 2, 0, 2]])
    lab = from_draws(draws)
    p = np.exp(lab.logp)
    assert lab.ids.tolist() == [[3, 5, 7, 3], [1, 1, 1, 1], [6, 7, 8, 9], [0, 2, 0, 0]]
    assert np.allclose(p, [[.25, .5, .25, 0], [1, 0, 0, 0], [.25] * 4, [.25, .75, 0, 0]])
    assert np.isfinite(lab.logp).all()  # an empty slot's log-probability is finite
    data = encode(lab, 10, Values.DRAWS)
    assert len(data) == payload_nbytes(4, 4, 10, Values.DRAWS) == (16 * 4 + 7) // 8
    out = decode(data, 4, 4, 10, Values.DRAWS)
    assert np.array_equal(out.ids, lab.ids) and np.allclose(out.logp, lab.logp)
    assert np.array_equal(to_draws(out), np.sort(draws, axis=1))
    with pytest.raises(WireError, match="not 4 draws a row"):  # a top k is no draws
        encode(labels(2, 4, 10), 10, Values.DRAWS)


def test_a_payload_of_another_length_or_with_ids_outside_the_vocabulary_is_refused() -> None:
    src = labels(3, 4, 300)
    data = encode(src, 300, Values.FP16)
    with pytest.raises(WireError, match="expected"):
        decode(data[:-1], 3, 4, 300, Values.FP16)
    with pytest.raises(WireError, match="outside the vocabulary"):
        encode(SparseLabels(np.array([[300]]), np.zeros((1, 1), np.float32)), 300, Values.FP16)
    forged = bytearray(data)
    forged[0] = 0xFF  # the first id's high bits: 9-bit ids, 511 > 299
    with pytest.raises(WireError, match="outside the vocabulary"):
        decode(forged, 3, 4, 300, Values.FP16)
    nan = bytearray(encode(src, 300, Values.FP16))
    nan[-2:] = np.array([np.nan], dtype="<f2").tobytes()
    with pytest.raises(WireError, match="not finite"):
        decode(nan, 3, 4, 300, Values.FP16)


def test_token_values_cross_as_two_bytes_a_position_and_need_the_ids_they_score() -> None:
    """`mode: on_policy` (values "token"): one fp16 log-probability a position, no ids (the
    asker has them: each sequence's next token, `next_tokens`); the last position says 0."""
    tokens = np.array([[5, 9, 2, 7], [1, 1, 3, 0]])
    scored = next_tokens(tokens.reshape(-1), 4)
    assert scored.reshape(2, 4).tolist() == [[9, 2, 7, 7], [1, 3, 0, 0]]
    logp = np.array([[-0.25], [-3.5], [-1.0], [0.0], [-2.0], [-0.125], [-7.0], [0.0]],
                    np.float32)
    data = encode(SparseLabels(scored, logp), 10, Values.TOKEN)
    assert len(data) == payload_nbytes(8, 1, 10, Values.TOKEN) == 16
    back = decode(data, 8, 1, 10, Values.TOKEN, scored)
    assert np.array_equal(back.ids, scored) and np.array_equal(back.logp, logp)
    with pytest.raises(WireError, match="without the 8 ids"):
        decode(data, 8, 1, 10, Values.TOKEN)
    with pytest.raises(WireError, match="one a position"):
        encode(labels(3, 2, 10), 10, Values.TOKEN)
    above = np.frombuffer(np.full(8, 0.5, "<f2").tobytes(), np.uint8).tobytes()
    with pytest.raises(WireError, match="above 0"):
        decode(above, 8, 1, 10, Values.TOKEN, scored)
