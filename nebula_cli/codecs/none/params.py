"""The ``none`` codec as the plan knows it: fp32 as is (config layer, standard library only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nebula_cli.config.codec_knobs import CodecParams


@dataclass(frozen=True)
class NoneParams(CodecParams):
    """fp32 as is: exact."""

    name: ClassVar[str] = "none"
    rel_error: ClassVar[float] = 0.0

    def bytes_per_element(self) -> float:
        return 4.0


PARAMS = (NoneParams,)
"""This package's codecs' params (`nebula_cli/codecs/registry.py`)."""
