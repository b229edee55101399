"""The ``none`` codec on the wire (relay layer): fp32 as is, 4 bytes per element, exact; see
:mod:`nebula_cli.relay.codecs.registry` for every codec's payload and error bound side by side."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from nebula_cli.codecs.none.params import NoneParams
from nebula_cli.relay.codecs.base import (
    Codec,
    CodecError,
    Encoded,
    buffer_view,
    check_input,
    prepare,
)


class NoneCodec(Codec):
    """fp32 as is: 4 bytes per element, exact."""

    Params = NoneParams
    error_bound = "exact"

    def payload_nbytes(self, numel: int, meta: Mapping[str, Any] | None = None) -> int:
        self.check_meta(meta or {})
        return 4 * numel

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(prepare(x))

    def encode_view(self, x: torch.Tensor) -> Encoded:
        """fp32 as is: the payload is a view of the chunk, no copy."""
        return Encoded(self.name, x.numel(), {}, memoryview(x.numpy()).cast("B"))

    def decode_view(self, enc: Encoded) -> torch.Tensor | None:
        """A view of the received buffer (no copy); None for an encoding not of this codec or
        with meta (`decode` refuses it, naming why)."""
        if enc.codec != self.name or enc.meta:
            return None
        view = memoryview(enc.payload).cast("B")
        if view.nbytes != 4 * enc.numel:
            raise CodecError(f"none: payload of {view.nbytes} bytes for {enc.numel} elements")
        if enc.numel == 0:
            return torch.empty(0)
        with warnings.catch_warnings():  # read-only buffers (own chunks) are only read
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view, dtype=torch.float32)

    def _encode(self, x: torch.Tensor) -> Encoded:
        check_input(x, self.name, math.inf)
        buf = bytearray(4 * x.numel())
        buffer_view(buf, torch.float32, 0, x.numel()).copy_(x)
        return Encoded(self.name, x.numel(), {}, buf)

    def _decode(self, enc: Encoded, out: torch.Tensor) -> None:
        out.copy_(buffer_view(enc.payload, torch.float32, 0, enc.numel))


CODECS = (NoneCodec,)
"""This package's codecs (`nebula_cli/codecs/registry.py`)."""
