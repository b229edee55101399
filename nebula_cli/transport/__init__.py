"""How commands and files reach a host: `Transport` and its implementations, and `Conn`, the
typed description of how to reach a host (one kind per transport, routed in `registry`)."""

from __future__ import annotations

from nebula_cli.transport.base import CommandResult, Transport
from nebula_cli.transport.conn import Conn
from nebula_cli.transport.local.transport import LocalTransport
from nebula_cli.transport.registry import conn_from_data, describe

__all__ = [
    "CommandResult", "Conn", "LocalTransport", "Transport", "conn_from_data", "describe",
]
