"""Sparse soft labels on the wire: per token k (id, log-probability) pairs of the teacher's.

An answer for ``rows`` tokens is one payload, in this order:

- ids: ``rows * k`` ids of ``id_bits(vocab)`` bits each (the fewest that hold ``vocab - 1``),
  packed big-endian bit after bit, the last byte padded with zeros (`idpack`, as an ask's
  token ids are);
- values, by ``Values``: ``fp16``: ``rows * k`` IEEE half floats (little-endian), 2 bytes each;
  ``int8``: per row its lowest and highest value as two half floats, then ``rows * k`` bytes,
  each value quantized linearly between them (255 steps; 1 byte a label, 4 bytes a row);
  ``draws``: none. The ids are k tokens drawn from the teacher's distribution, with repeats,
  in ascending order; a token's value is how often it was drawn, over k (`from_draws`);
  ``token`` (on-policy distillation, k = 1): no ids, ``rows`` half floats: at each position the
  teacher's log-probability of the asked sequence's next token (the student's own sample: it
  knows the ids, so they are not sent back); a sequence's last position, which has no next
  token, says 0.

With ``fp16`` and ``int8`` the ids are the teacher's top k and the values their
log-probabilities at the job's temperature, highest first. The length of a payload is known
from (rows, k, vocab, values) alone: a payload of another length is refused before anything
is read from it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from nebula_cli.relay.distill.idpack import MAX_ID_BITS, pack_ids, packed_nbytes, unpack_ids
from nebula_cli.relay.net.wire import WireError

MAX_VOCAB = 1 << MAX_ID_BITS
"""The largest vocabulary an id may index (24 bits)."""


class Values(StrEnum):
    """How a soft label's value crosses the wire."""

    FP16 = "fp16"
    INT8 = "int8"
    DRAWS = "draws"
    """No values: the ids are draws from the teacher's distribution (`from_draws`)."""
    TOKEN = "token"
    """No ids: one value per position, the teacher's log-probability of the asked sequence's
    next token (`next_tokens`: the ids, which the asker has)."""


ABSENT = -1.0e4
"""The log-probability of a slot that holds no token (``draws``: a row with fewer distinct
tokens than draws): finite, so that 0 * (ABSENT - log q) stays 0 in the loss."""


def id_bits(vocab: int) -> int:
    """Bits of one token id for a vocabulary of ``vocab`` tokens."""
    if not 2 <= vocab <= MAX_VOCAB:
        raise WireError(f"a vocabulary of {vocab} tokens; expected 2..{MAX_VOCAB}")
    return (vocab - 1).bit_length()


def payload_nbytes(rows: int, k: int, vocab: int, values: Values) -> int:
    """The exact length of an answer's payload."""
    if values is Values.TOKEN:
        id_bits(vocab)  # (the vocabulary still checked)
        return rows * k * 2
    ids = packed_nbytes(rows * k, id_bits(vocab))
    vals = {Values.FP16: rows * k * 2, Values.INT8: rows * (4 + k), Values.DRAWS: 0}[values]
    return ids + vals


def next_tokens(tokens: np.ndarray, width: int) -> np.ndarray:
    """The ids ``token`` values score: for every position of sequences of ``width`` tokens laid
    one after the other in ``tokens``, the sequence's next token, as (positions, 1) int64; a
    sequence's last position repeats its own token (its value is 0 and scores nothing)."""
    seqs = np.asarray(tokens, dtype=np.int64).reshape(-1, width)
    out = np.concatenate([seqs[:, 1:], seqs[:, -1:]], axis=1)
    return out.reshape(-1, 1)


@dataclass(frozen=True)
class SparseLabels:
    """``rows`` tokens' k labels: ``ids`` (rows, k) int64 and ``logp`` (rows, k) float32, the
    log-probabilities the teacher gives those ids (a row's probabilities sum to at most 1)."""

    ids: np.ndarray
    logp: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])


def from_draws(draws: np.ndarray) -> SparseLabels:
    """The labels of ``draws`` (rows, k): token ids drawn from the teacher's distribution. Per
    row its distinct ids, ascending, each with log(times drawn / k), then slots of the row's
    first id with `ABSENT`: an unbiased estimate of the teacher's distribution ("sparse logit
    sampling", Anshumann et al., ACL 2025), where a top k leaves the tail out."""
    draws = np.sort(np.asarray(draws, dtype=np.int64), axis=1)
    rows, k = draws.shape
    if not draws.size:
        return SparseLabels(draws, np.zeros((rows, k), np.float32))
    # rows apart by their index (each row's ids < span): one sorted array, one search each way
    span = int(draws.max()) + 1
    flat = (draws + np.arange(rows, dtype=np.int64)[:, None] * span).reshape(-1)
    first = np.searchsorted(flat, flat, side="left")
    times = np.searchsorted(flat, flat, side="right") - first
    distinct = first == np.arange(flat.size)
    slot = (np.cumsum(distinct.reshape(rows, k), axis=1) - 1).reshape(-1)
    where = np.arange(rows).repeat(k) * k + slot
    ids = np.repeat(draws[:, :1], k, axis=1).reshape(-1)
    logp = np.full(rows * k, ABSENT, np.float32)
    ids[where[distinct]] = draws.reshape(-1)[distinct]
    logp[where[distinct]] = np.log(times[distinct] / k)
    return SparseLabels(ids.reshape(rows, k), logp.reshape(rows, k))


def to_draws(labels: SparseLabels) -> np.ndarray:
    """The draws (rows, k), ascending, that `from_draws` made ``labels`` of; labels whose
    probabilities are not whole draws summing to k are refused."""
    k = labels.k
    times = np.rint(np.exp(np.asarray(labels.logp, np.float64)) * k).astype(np.int64)
    if labels.rows and not (times.sum(axis=1) == k).all():
        raise WireError(f"labels that are not {k} draws a row")
    draws = np.repeat(np.asarray(labels.ids, np.int64).reshape(-1), times.reshape(-1))
    return np.sort(draws.reshape(labels.rows, k), axis=1)


def encode(labels: SparseLabels, vocab: int, values: Values) -> bytes:
    """The payload of ``labels`` (see the module's docstring)."""
    bits = id_bits(vocab)
    if values is Values.TOKEN:
        if labels.k != 1:
            raise WireError(f"token values are one a position, not {labels.k}")
        return np.asarray(labels.logp, dtype=np.float32).astype("<f2").tobytes()
    ids = np.ascontiguousarray(to_draws(labels) if values is Values.DRAWS else labels.ids,
                               dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise WireError(f"a soft label's id outside the vocabulary of {vocab}")
    packed = pack_ids(ids, bits)
    logp = np.asarray(labels.logp, dtype=np.float32)
    if values is Values.DRAWS:
        return packed
    if values is Values.FP16:
        return packed + logp.astype("<f2").tobytes()
    lo, hi = logp.min(axis=1, keepdims=True), logp.max(axis=1, keepdims=True)
    lo16, hi16 = lo.astype("<f2"), hi.astype("<f2")
    span = hi16.astype(np.float32) - lo16.astype(np.float32)
    scaled = (logp - lo16.astype(np.float32)) / np.where(span > 0, span, 1.0) * 255.0
    q = np.clip(np.rint(scaled), 0, 255).astype(np.uint8)
    return packed + np.concatenate([lo16, hi16], axis=1).tobytes() + q.tobytes()


def decode(payload: bytes | bytearray | memoryview, rows: int, k: int, vocab: int,
           values: Values, scored: np.ndarray | None = None) -> SparseLabels:
    """``rows`` tokens' labels from a payload of exactly ``payload_nbytes`` bytes; ``token``
    values need ``scored``, the ids they score (`next_tokens` of what was asked)."""
    want = payload_nbytes(rows, k, vocab, values)
    if len(payload) != want:
        raise WireError(f"soft labels of {rows} tokens x {k} in {len(payload)} bytes; "
                        f"expected {want}")
    if values is Values.TOKEN:
        if k != 1 or scored is None or scored.shape != (rows, 1):
            raise WireError(f"token values of {rows} x {k} without the {rows} ids they score")
        logp = np.frombuffer(payload, dtype="<f2").astype(np.float32).reshape(rows, 1)
        if not np.isfinite(logp).all() or (logp > 0).any():
            raise WireError("a token's log-probability that is not finite or above 0")
        return SparseLabels(np.asarray(scored, np.int64), logp)
    bits = id_bits(vocab)
    data = np.frombuffer(payload, dtype=np.uint8)
    id_bytes = packed_nbytes(rows * k, bits)
    ids = unpack_ids(data[:id_bytes], rows * k, bits)
    if ids.size and ids.max() >= vocab:
        raise WireError(f"a soft label's id {int(ids.max())} outside the vocabulary of {vocab}")
    rest = data[id_bytes:]
    if values is Values.DRAWS:
        return from_draws(ids.reshape(rows, k))
    if values is Values.FP16:
        logp = rest.view("<f2").astype(np.float32).reshape(rows, k)
    else:
        bounds = rest[: rows * 4].view("<f2").astype(np.float32).reshape(rows, 2)
        q = rest[rows * 4:].astype(np.float32).reshape(rows, k)
        logp = bounds[:, :1] + q / 255.0 * (bounds[:, 1:] - bounds[:, :1])
    if not np.isfinite(logp).all():
        raise WireError("soft labels with a value that is not finite")
    return SparseLabels(ids.reshape(rows, k), logp)
