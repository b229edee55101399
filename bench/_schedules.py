"""The 200-step schedule each codec is benchmarked with (bench/wan_training.py and
bench/diloco_schedule.py): H, outer lr, outer momentum. docs/benchmarks.md has how they were
chosen; the spec's own defaults for long runs are in nebula_cli/config/sections.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nebula_cli.config.codec_knobs import DENSE_OUTER  # noqa: E402

SCHEDULE: dict[str, tuple[int, float, float]] = {"topk": (10, 2.5, 0.0)}
"""topk's rounds are 80x smaller than fp32's, so it syncs every 10 steps; its error feedback
carries the past rounds, so no outer momentum."""
SCHEDULE_DEFAULT = (25, *DENSE_OUTER)
"""Every other codec: a round every 25 steps, the spec's outer lr and Nesterov momentum for dense
codecs (0.6 / 0.5; DiLoCo's 0.7 / 0.9 overshoots with only 8 rounds)."""


def schedule(codec: str) -> tuple[int, float, float]:
    """(H, outer lr, outer momentum) for a codec."""
    return SCHEDULE.get(codec, SCHEDULE_DEFAULT)
