"""Token ids in few bits (`relay.distill.idpack`): every width 1..24 round-trips, also where the
last byte is only partly filled; the layout is big-endian bit after bit; exact lengths; ids and
widths out of range refused, naming them."""

from __future__ import annotations

import numpy as np
import pytest

from nebula_cli.relay.distill.idpack import (
    MAX_ID_BITS,
    bits_needed,
    pack_ids,
    packed_nbytes,
    unpack_ids,
)
from nebula_cli.relay.net.wire import WireError


@pytest.mark.parametrize("bits", range(1, MAX_ID_BITS + 1))
def test_every_width_round_trips_at_every_fill_of_the_last_byte(bits: int) -> None:
    rng = np.random.default_rng(bits)
    for count in (1, 2, 3, 5, 7, 8, 9, 13, 100):
        ids = rng.integers(0, 1 << bits, size=count)
        ids[0] = (1 << bits) - 1  # the largest id of the width, every bit set
        data = pack_ids(ids, bits)
        assert len(data) == packed_nbytes(count, bits) == (count * bits + 7) // 8
        out = unpack_ids(data, count, bits)
        assert out.dtype == np.int64 and np.array_equal(out, ids)
        pad = len(data) * 8 - count * bits
        assert data[-1] & ((1 << pad) - 1) == 0  # the padding: zeros


def test_ids_are_packed_big_endian_bit_after_bit() -> None:
    assert pack_ids(np.array([1, 2, 3]), 2) == bytes([0b01_10_11_00])
    assert pack_ids(np.array([[5, 1]]), 11) == bytes([0b00000000, 0b101_00000, 0b000001_00])
    assert pack_ids(np.array([0xABCDEF]), 24) == bytes([0xAB, 0xCD, 0xEF])


def test_the_bits_an_ask_needs_are_the_largest_ids() -> None:
    assert [bits_needed(np.array(v)) for v in ([0], [1], [0, 2], [2047], [2048, 3])] == \
        [1, 1, 2, 11, 12]
    assert bits_needed(np.array([(1 << 24) - 1], dtype=np.uint32)) == 24


@pytest.mark.parametrize("ids, says", [
    ([3, -1], "token id -1 is negative; ids are 0..16777215"),
    ([1 << 24], "token id 16777216 does not fit in 24 bits; ids are 0..16777215"),
    (np.array([1 << 32], dtype=np.uint64), "token id 4294967296 does not fit in 24 bits"),
])
def test_ids_outside_24_bits_are_refused_naming_the_id_and_the_bound(ids: list, says: str) -> None:
    with pytest.raises(WireError, match=says):
        bits_needed(np.array(ids))
    with pytest.raises(WireError, match=says):
        pack_ids(np.array(ids), 24)


def test_a_wrong_width_length_or_dtype_is_refused() -> None:
    with pytest.raises(WireError, match="does not fit in 3 bits"):
        pack_ids(np.array([8]), 3)
    for bits in (0, 25):
        with pytest.raises(WireError, match=f"ids of {bits} bits; expected 1..24"):
            pack_ids(np.array([0]), bits)
        with pytest.raises(WireError, match=f"ids of {bits} bits"):
            unpack_ids(b"\0" * 4, 1, bits)
    data = pack_ids(np.arange(10), 11)
    for wrong in (data[:-1], data + b"\0"):
        with pytest.raises(WireError, match="10 ids of 11 bits in .* bytes; expected 14"):
            unpack_ids(wrong, 10, 11)
    with pytest.raises(WireError, match="dtype float64"):
        pack_ids(np.array([1.5]), 8)
