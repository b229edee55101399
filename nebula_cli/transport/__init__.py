"""How commands and files reach a host: `Transport` and its implementations."""

from __future__ import annotations

from typing import Any

from nebula_cli.errors import UsageError
from nebula_cli.transport.base import CommandResult, Transport
from nebula_cli.transport.local import LocalTransport, local_python

__all__ = [
    "CommandResult", "LocalTransport", "Transport", "connect", "describe", "machine_key",
]


def machine_key(conn: dict[str, Any]) -> tuple[Any, ...]:
    """Hosts with the same key are the same machine (one connection serves them all)."""
    if conn["transport"] == "local":
        return ("local", conn.get("home"))
    return ("ssh", conn.get("user"), conn.get("host"), conn.get("port"), conn.get("jump"))


def describe(kind: str, *, name: str, home: str, host: str | None = None,
             user: str | None = None, port: int | None = None, key: str | None = None,
             jump: str | None = None, python: str) -> dict[str, Any]:
    """How to reach a host, as plain data (kept in the state store; `connect` opens it).
    `home` is used by transports whose hosts share this machine; remote hosts find their own."""
    if kind == "local":
        return {"transport": "local", "name": name, "home": home, "python": local_python(python)}
    if kind == "ssh":
        return {"transport": "ssh", "name": name, "host": host or name, "user": user,
                "port": port, "key": key, "jump": jump, "python": python}
    raise UsageError(f"transport '{kind}' is not available in this version of nebula")


def connect(conn: dict[str, Any], *, accept_new_host_keys: bool = False) -> Transport:
    """A transport for a connection description made by `describe`."""
    kind = conn.get("transport")
    if kind == "local":
        return LocalTransport(conn["name"], home=conn["home"], python=conn.get("python"))
    if kind == "ssh":
        from nebula_cli.transport.ssh import CONNECT_TIMEOUT, SSHTransport  # paramiko on demand

        return SSHTransport(
            conn["name"], conn.get("host"),
            user=conn.get("user"), port=conn.get("port"), key=conn.get("key"),
            jump=conn.get("jump"), python=conn.get("python"),
            home=conn.get("home") or "~/.nebula",
            ssh_config=conn.get("ssh_config"), known_hosts=conn.get("known_hosts"),
            accept_new_host_keys=accept_new_host_keys or bool(conn.get("accept_new_host_keys")),
            connect_timeout=float(conn.get("connect_timeout") or CONNECT_TIMEOUT),
        )
    raise UsageError(f"transport '{kind}' is not available in this version of nebula")
