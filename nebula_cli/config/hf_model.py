"""What nebula reads of a Hugging Face model's config (its config.json, or a loaded model's
`config.to_dict()`): the vocabulary (the logits' width, `vocab_size`) and the positions it
runs, wherever the model family keeps them (top level, or a multimodal model's
`text_config`). One reader for `validate`'s check before launch and the built-in teacher
server."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")
"""The config keys of a model's positions, as Hugging Face's model families name them."""


def _field(config: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    inner = config.get("text_config")
    for where in (config, inner if isinstance(inner, Mapping) else {}):
        for key in keys:
            value = where.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def vocab_of(config: Mapping[str, Any]) -> int | None:
    """The model's vocabulary, the width of its logits (None: not said)."""
    return _field(config, ("vocab_size",))


def positions_of(config: Mapping[str, Any]) -> int | None:
    """The most positions the model runs (None: not said)."""
    return _field(config, POSITION_KEYS)
