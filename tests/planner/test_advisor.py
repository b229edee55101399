"""planner/advisor.py: the advisor prices each codec with what the codec says it costs
(`CodecParams.bytes_per_element`), topk included (its knobs too, and its encodings sent to
every other relay), and ranks codecs by their relative error bounds."""

from __future__ import annotations

import pytest

from nebula_cli.codecs.int8.params import Int8Params
from nebula_cli.codecs.topk.params import TopKParams
from nebula_cli.planner.advisor import (
    ACCURACY_ORDER,
    DEFAULT_CODECS,
    advise,
    codec_cost,
    predict,
    wan_seconds,
)
from nebula_cli.planner.costmodel import PlanError

P, STEP, MBIT, RTT = 100_000_000, 0.2, 1000, 50


def test_codecs_are_ranked_by_their_error_bounds_topk_last() -> None:
    assert ACCURACY_ORDER == ("none", "fp16", "bf16", "int8", "topk")
    assert set(DEFAULT_CODECS) == {"none", "fp16", "bf16", "int8"}  # topk when asked for


def test_topk_is_priced_by_its_payload() -> None:
    # 100 M parameters at 0.05078125 B each: 5.078 MB, 0.040625 s at 1 Gbit/s, plus 3 rtt
    two = predict("topk", 10, params=P, step_time_s=STEP, bandwidth_mbit=MBIT, rtt_ms=RTT,
                  clusters=2)
    assert two.bytes_per_round == pytest.approx(P * 0.05078125)
    assert two.wan_s == pytest.approx(P * 0.05078125 * 8 / 1e9 + 0.15)
    # three clusters: a sparse encoding goes to each of the two others (dense: 4/3 of it)
    three = predict("topk", 10, params=P, step_time_s=STEP, bandwidth_mbit=MBIT, rtt_ms=RTT,
                    clusters=3)
    assert three.wan_s == pytest.approx(2 * P * 0.05078125 * 8 / 1e9 + 0.15)
    assert wan_seconds(1e9, 1000, 0, 3) == pytest.approx(4 / 3 * 8)
    assert wan_seconds(1e9, 1000, 0, 3, sparse=True) == pytest.approx(2 * 8)
    # its knobs: 2 of 16 kept, 4 bits each
    dense_k = predict("topk", 10, params=P, step_time_s=STEP, bandwidth_mbit=MBIT, rtt_ms=RTT,
                      clusters=2, codec_params=TopKParams(density=0.125, bits=4))
    assert dense_k.bytes_per_round == pytest.approx(P * (4 / 1024 + 0.125 * (4 + 4) / 8))
    int8 = predict("int8", 10, params=P, step_time_s=STEP, bandwidth_mbit=MBIT, rtt_ms=RTT,
                   clusters=2, codec_params=Int8Params(block_size=64))
    assert int8.bytes_per_round == pytest.approx(P * (1 + 4 / 64))


def test_asked_for_topk_takes_part_in_the_advice() -> None:
    # at 20 Mbit/s a topk round costs 2.18 s (95 % from H 208), an int8 round 40.8 s (H 3874)
    a = advise(P, STEP, 20, RTT, codecs=("int8", "topk"), h_values=(10, 100, 1000))
    assert (a.recommended.codec, a.recommended.inner_steps, a.reached) == ("topk", 1000, True)
    assert a.needed_h == {"int8": 3874, "topk": 208}
    fast = advise(P, STEP, 100_000, 0, codecs=("int8", "topk"), h_values=(10, 100))
    assert fast.recommended.codec == "int8"  # both reach it at H 10: the more faithful


def test_unknown_codecs_and_params_of_another_codec_are_refused() -> None:
    assert codec_cost("topk") == TopKParams()
    with pytest.raises(PlanError, match="unknown codec 'zstd'; known: none, fp16, bf16, int8, "
                                        "topk"):
        codec_cost("zstd")
    with pytest.raises(PlanError, match="are not those of codec int8"):
        predict("int8", 1, params=10, step_time_s=1, bandwidth_mbit=1, rtt_ms=0, clusters=2,
                codec_params=TopKParams())
    with pytest.raises(PlanError, match="unknown codec"):
        advise(10, 1.0, 10, 10, codecs=("zstd",))
