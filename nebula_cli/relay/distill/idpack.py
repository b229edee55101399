"""Token ids on the wire in as few bits as they need: ``count`` ids of ``bits`` bits each
(1..24), packed big-endian bit after bit (an id's highest bit first, one id after the other),
the last byte padded with zeros: exactly ``packed_nbytes(count, bits)`` bytes. The one packing
of ids, for an answer's label ids (`sparse`) and an ask's token ids (``LabelAsk``).
"""

from __future__ import annotations

import numpy as np

from nebula_cli.relay.net.wire import WireError

MAX_ID_BITS = 24
"""The most bits of one id (ids 0 .. 2**24 - 1)."""


def packed_nbytes(count: int, bits: int) -> int:
    """The exact length of ``count`` packed ids of ``bits`` bits."""
    return (count * bits + 7) // 8


def bits_needed(ids: np.ndarray) -> int:
    """The bit length of the largest of ``ids`` (at least 1): the fewest bits that hold them
    all. An id outside 0 .. 2**24 - 1 is refused."""
    arr = np.asarray(ids)
    if not arr.size:
        return 1
    _check_range(arr, MAX_ID_BITS)
    return max(1, int(arr.max()).bit_length())


def pack_ids(ids: np.ndarray, bits: int) -> bytes:
    """``ids`` (any shape, integers in 0 .. 2**bits - 1), flattened and packed."""
    _check_bits(bits)
    arr = np.asarray(ids)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise WireError(f"token ids of dtype {arr.dtype}; expected integers")
    _check_range(arr, bits)
    flat = arr.astype(np.int64).reshape(-1)
    shifts = np.arange(bits - 1, -1, -1, dtype=np.int64)
    return np.packbits(((flat[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1)).tobytes()


def unpack_ids(data: bytes | bytearray | memoryview | np.ndarray, count: int,
               bits: int) -> np.ndarray:
    """``count`` ids (int64, flat) from exactly ``packed_nbytes(count, bits)`` bytes."""
    _check_bits(bits)
    raw = np.frombuffer(data, dtype=np.uint8)
    want = packed_nbytes(count, bits)
    if raw.size != want:
        raise WireError(f"{count} ids of {bits} bits in {raw.size} bytes; expected {want}")
    flat = np.unpackbits(raw)[: count * bits].reshape(count, bits)
    return flat.astype(np.int64) @ (np.int64(1) << np.arange(bits - 1, -1, -1, dtype=np.int64))


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= MAX_ID_BITS:
        raise WireError(f"ids of {bits} bits; expected 1..{MAX_ID_BITS}")


def _check_range(arr: np.ndarray, bits: int) -> None:
    """Refuse an id outside 0 .. 2**bits - 1, naming it and the bound."""
    if not arr.size:
        return
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise WireError(f"token id {lo} is negative; ids are 0..{(1 << bits) - 1}")
    if hi >= 1 << bits:
        raise WireError(f"token id {hi} does not fit in {bits} bits; ids are "
                        f"0..{(1 << bits) - 1}")
