"""Error feedback around a codec: what one round's encoding lost is added to the next round's
input (per key), so nothing is lost, only delayed; or, with a decay beta < 1 (SparseLoCo's outer
step, arXiv 2508.15706), what was left out fades by beta each round, so the residual is a
momentum of what has not been sent yet rather than a debt paid in full, however stale."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

from nebula_cli.relay.codecs.base import Codec, CodecError, Encoded, prepare


class ErrorFeedback:
    """Error feedback around a codec: what rounding lost for a key in one round is added to that
    key's next input, so the sum of decoded values tracks the sum of inputs (their difference is
    the current residual, bounded by one round's codec error). With a decay beta < 1 the
    input is x + beta residual: a residual left unsent for n rounds counts beta**n. ``decay``:
    None (the default) takes each round's codec's own (``CodecParams.feedback_decay``: topk
    0.7, the dense codecs 1); one beta for every codec; or a beta per codec name (``{"int8":
    1.0, "topk": 0.9}``; a codec it does not name takes its own). The codec of the round being
    encoded decides (``compression: auto`` switches between rounds)."""

    def __init__(self, codec: Codec, decay: float | Mapping[str, float] | None = None) -> None:
        betas = (decay.values() if isinstance(decay, Mapping)
                 else [] if decay is None else [decay])
        for beta in betas:
            if not 0.0 < beta <= 1.0:
                raise CodecError(f"error feedback: decay must be in (0, 1], got {beta!r}")
        self.codec = codec
        self._decay = decay
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def decay(self, codec: Codec | None = None) -> float:
        """The beta of a round encoded with ``codec`` (default: the one given at
        construction)."""
        codec = codec or self.codec
        if isinstance(self._decay, Mapping):
            return self._decay.get(codec.name, codec.Params.feedback_decay)
        return codec.Params.feedback_decay if self._decay is None else self._decay

    def encode(self, x: torch.Tensor, key: Hashable, codec: Codec | None = None) -> Encoded:
        """Encode x + decay residual[key] (with ``codec``, default the one given at
        construction); keep residual[key] := that input - decode(encoding). The residual is a
        dense fp32 tensor whatever the codec, so a round may change codecs (``compression:
        auto``): what one codec left out goes into the next codec's input. On a CodecError the
        residual is left as it was."""
        codec = codec or self.codec
        x = prepare(x)
        residual = self._residuals.get(key)
        if residual is not None and residual.numel() != x.numel():
            raise CodecError(
                f"error feedback for {key!r}: got {x.numel()} elements, the kept residual has "
                f"{residual.numel()} (reset() it when the layout changes)"
            )
        target = x if residual is None else torch.add(x, residual, alpha=self.decay(codec))
        enc = codec.encode(target)
        self._residuals[key] = target - codec.decode(enc)
        return enc

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The residual kept for key (None if there is none)."""
        return self._residuals.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of key, or of every key when key is None."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)
