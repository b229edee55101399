"""Session: the launching machine's handle on a job's hosts: the state store and one reused
transport per machine (thread-safe), plus the host agent's command line."""

from __future__ import annotations

import threading
from typing import Any

from nebula_cli.control.state import HostRecord, StateStore
from nebula_cli.transport import Transport, connect, machine_key


class Session:
    """Connections to hosts, opened on first use and reused; close it to release them."""

    def __init__(self, store: StateStore, *, accept_new_host_keys: bool = False) -> None:
        self.store = store
        self.accept_new_host_keys = accept_new_host_keys
        self._transports: dict[tuple[Any, ...], Transport] = {}
        self._lock = threading.Lock()

    def transport(self, conn: dict[str, Any]) -> Transport:
        """The one transport of the machine `conn` describes (made once, safe from threads)."""
        key = machine_key(conn)
        login = self.transport(conn["login"]) if "login" in conn else None  # a Slurm node's
        with self._lock:
            t = self._transports.get(key)
            if t is None:
                t = self._transports[key] = connect(
                    conn, accept_new_host_keys=self.accept_new_host_keys,
                    via=None if login is None else lambda _: login)
            return t

    def transport_of(self, rec: HostRecord) -> Transport:
        return self.transport(rec.detail["conn"])

    def close(self) -> None:
        with self._lock:
            transports = list(self._transports.values())
            self._transports.clear()
        for t in transports:
            t.close()

    def abort(self) -> None:
        """Cancel what other threads are doing through this session's transports: each is
        closed for good (what runs returns with an error, nothing more starts over it); later
        calls of `transport` open new ones."""
        with self._lock:
            transports = list(self._transports.values())
            self._transports.clear()
        for t in transports:
            t.abort()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _agent(self, conn: dict[str, Any], *args: str) -> list[str]:
        """The agent command line; on remote hosts nebula_cli comes from the job's lib dir."""
        argv = [conn["python"], "-m", "nebula_cli.agent", *args]
        if conn.get("pythonpath"):
            return ["env", f"PYTHONPATH={conn['pythonpath']}", *argv]
        return argv
