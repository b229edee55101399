"""The `dummy` codec as the plan knows it: fp32 as is, with one knob of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nebula_cli.config.codec_knobs import CodecParams, knob


@dataclass(frozen=True)
class DummyParams(CodecParams):
    """fp32 as is, named `dummy`; `dummy_copies` only shows a knob reaching the spec."""

    name: ClassVar[str] = "dummy"
    rel_error: ClassVar[float] = 0.0

    dummy_copies: int = knob(1, ge=1, le=4)
    """How many copies of the payload it would send (priced, not sent)."""

    def bytes_per_element(self) -> float:
        return 4.0 * self.dummy_copies


PARAMS = (DummyParams,)
