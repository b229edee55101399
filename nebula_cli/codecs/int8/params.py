"""The ``int8`` codec as the plan knows it: blockwise absmax int8, its block size (config layer,
standard library only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nebula_cli.config.codec_knobs import CodecParams, knob


@dataclass(frozen=True)
class Int8Params(CodecParams):
    """Blockwise absmax int8: one float32 scale per block, then one byte per element."""

    name: ClassVar[str] = "int8"
    auto: ClassVar[bool] = True
    rel_error: ClassVar[float] = 1 / 254  # half a step of the block's absmax / 127

    block_size: int = knob(256, ge=16, only_this_codec=False)
    """Values per scale. The relays also cut every tensor into chunks of whole blocks whatever
    the codec (so that ``compression: auto`` switches codecs on the same chunk boundaries):
    the spec accepts it with any codec."""

    def bytes_per_element(self) -> float:
        return 1.0 + 4.0 / self.block_size


PARAMS = (Int8Params,)
"""This package's codecs' params (`nebula_cli/codecs/registry.py`)."""
