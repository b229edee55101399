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


def test_a_run_writes_its_plots_to_a_folder_it_is_given_or_a_new_one() -> None:
    """Without --out the plots and samples go to a new temporary folder, never over the
    committed docs/soak (round_memory.py takes the same default)."""
    soak = load_bench("soak")
    assert soak.parse_args([]).out is None
    assert load_bench("round_memory").parse_args([]).out is None
    made = soak.out_folder(None)
    try:
        assert made.is_dir() and not list(made.iterdir())
        assert soak.REPO not in made.parents
    finally:
        made.rmdir()
    given = soak.out_folder(made / "named")
    try:
        assert given == made / "named" and given.is_dir()
    finally:
        given.rmdir()
        made.rmdir()
