"""How commands and files reach a host: `Transport` and its implementations."""

from __future__ import annotations

from collections.abc import Callable
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
    if conn["transport"] == "slurm-node":
        return ("slurm-node", conn["job"], conn["node"], *machine_key(conn["login"]))
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


def slurm_node(login: dict[str, Any], *, job: str, node: str, address: str,
               keeper: str, pythonpath: str) -> dict[str, Any]:
    """How to reach `node` of Slurm job `job` whose login node `login` describes."""
    return {"transport": "slurm-node", "name": node, "login": login, "job": job, "node": node,
            "address": address, "keeper": keeper, "python": login["python"],
            "pythonpath": pythonpath}


def connect(conn: dict[str, Any], *, accept_new_host_keys: bool = False,
            via: Callable[[dict[str, Any]], Transport] | None = None) -> Transport:
    """A transport for a connection description made by `describe` (or `slurm_node`, whose
    login node's transport `via` gives: one connection serves every node)."""
    kind = conn.get("transport")
    if kind == "slurm-node":
        from nebula_cli.transport.slurmnode import SlurmNodeTransport

        login = via(conn["login"]) if via is not None else connect(
            conn["login"], accept_new_host_keys=accept_new_host_keys)
        return SlurmNodeTransport(conn["name"], login, job=conn["job"], node=conn["node"],
                                  address=conn["address"], keeper=conn["keeper"],
                                  python=conn["python"], pythonpath=conn.get("pythonpath"))
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
