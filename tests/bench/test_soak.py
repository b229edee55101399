"""bench/soak.py's options: a run's length is calibrated from --minutes, or set in steps."""

from __future__ import annotations

from helpers.bench_modules import load_bench


def test_steps_set_the_length_and_minutes_keep_their_default() -> None:
    soak = load_bench("soak")
    set_ = soak.parse_args(["--steps", "8400"])
    assert set_.steps == 8400
    assert set_.minutes == soak.FULL["minutes"]  # (it places the stop and resume)
    calibrated = soak.parse_args(["--minutes", "70"])
    assert calibrated.steps is None and calibrated.minutes == 70
    quick = soak.parse_args(["--quick"])
    assert quick.steps is None and quick.minutes == soak.QUICK["minutes"]
