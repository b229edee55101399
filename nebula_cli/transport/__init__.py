"""How commands and files reach a host: `Transport` and its implementations."""

from __future__ import annotations

from typing import Any

from nebula_cli.errors import UsageError
from nebula_cli.transport.base import CommandResult, Transport
from nebula_cli.transport.local import LocalTransport

__all__ = ["CommandResult", "LocalTransport", "Transport", "connect", "machine_key"]


def machine_key(conn: dict[str, Any]) -> tuple[Any, ...]:
    """Hosts with the same key are the same machine (one connection serves them all)."""
    if conn["transport"] == "local":
        return ("local", conn.get("home"))
    return ("ssh", conn.get("user"), conn.get("host"), conn.get("port"), conn.get("jump"))


def connect(conn: dict[str, Any]) -> Transport:
    """A transport for a connection description made by `jobplan.connection_of`."""
    kind = conn.get("transport")
    if kind == "local":
        return LocalTransport(conn["name"], home=conn.get("home"), python=conn.get("python"))
    raise UsageError(f"transport '{kind}' is not available in this version of nebula")
