"""This cluster's contribution to a round: checked before it is sent, encoded chunk by chunk
in the background (:class:`OwnChunks`) while the exchange already runs, and decoded without a
copy when the codec is "none"."""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from nebula_cli.relay.codecs.base import Codec, CodecError, Encoded, all_finite, extremes
from nebula_cli.relay.codecs.chunks import iter_chunks
from nebula_cli.relay.codecs.feedback import ErrorFeedback
from nebula_cli.relay.protocol.allreduce import ExchangeError


def check_contribution(x: torch.Tensor, codec: Codec) -> str:
    """Why ``x`` may not be sent ("" if it may): non-finite, or beyond the codec's range."""
    if not x.numel():
        return ""
    limit = getattr(codec, "limit", math.inf)
    if limit == math.inf and all_finite(x):  # one fast pass (a sum) when there is no range
        return ""
    lo, hi = extremes(x)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "non-finite values (NaN or inf)"
    if max(-lo, hi) > limit:
        return f"values beyond the {codec.name} range (|x| <= {limit:g})"
    return ""


def decode(codec: Codec, enc: Encoded) -> torch.Tensor:
    """The codec's decode; a view of the received buffer (no copy) where the codec has one
    (`Codec.decode_view`: none's)."""
    view = codec.decode_view(enc)
    return view if view is not None else codec.decode(enc)


class OwnChunks:
    """This relay's encoded contribution, produced chunk by chunk by a background encoder."""

    def __init__(self, x: torch.Tensor, chunk_numel: int, align: int, codec: Any,
                 feedback: ErrorFeedback | None) -> None:
        self.chunks: list[Encoded] = []
        self.error: str | None = None
        self._cv = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, args=(x, chunk_numel, align, codec, feedback),
            name="relay-encoder", daemon=True)
        self._thread.start()

    def _run(self, x: torch.Tensor, chunk_numel: int, align: int, codec: Any,
             feedback: ErrorFeedback | None) -> None:
        try:
            for k, chunk in enumerate(iter_chunks(x, chunk_numel, align=align)):
                view = codec.encode_view(chunk)  # none's: fp32 as is, the payload a view
                if view is not None:
                    enc = view
                elif feedback is not None:
                    enc = feedback.encode(chunk, key=k, codec=codec)
                else:
                    enc = codec.encode(chunk)
                with self._cv:
                    self.chunks.append(enc)
                    self._cv.notify_all()
        except CodecError as exc:
            with self._cv:
                self.error = str(exc)
                self._cv.notify_all()

    def get(self, k: int, timeout: float) -> Encoded:
        with self._cv:
            if not self._cv.wait_for(lambda: len(self.chunks) > k or self.error, timeout):
                raise ExchangeError(f"encoding chunk {k} took longer than {timeout:g}s")
            if len(self.chunks) > k:
                return self.chunks[k]
            raise ExchangeError(f"encoding failed: {self.error}")
