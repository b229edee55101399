"""A message as the exact bytes of its frame's meta on the wire, for the tests that pin each
message's encoding (protocol 2): a frame as ``TYPE {meta}``, a message part as its meta."""

from __future__ import annotations

from typing import Any

from nebula_cli.relay.net.schema import encode
from nebula_cli.relay.net.wire import Frame, encode_meta


def pinned(obj: Any) -> str:
    """``obj`` (a Frame, or a message: its `schema.encode`) as the bytes the wire carries."""
    if isinstance(obj, Frame):
        return f"{obj.type.name} {encode_meta(obj.meta).decode()}"
    return encode_meta(encode(obj)).decode()
