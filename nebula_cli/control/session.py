"""Session: the launching machine's handle on a job's hosts: the state store and one reused
transport per machine (thread-safe), plus the host agent's command line."""

from __future__ import annotations

import threading
from typing import Any

from nebula_cli.control.state import HostRecord, StateStore
from nebula_cli.transport import Conn, Transport


class Session:
    """Connections to hosts, opened on first use and reused; close it to release them."""

    def __init__(self, store: StateStore, *, accept_new_host_keys: bool = False) -> None:
        self.store = store
        self.accept_new_host_keys = accept_new_host_keys
        self._transports: dict[tuple[Any, ...], Transport] = {}
        self._lock = threading.Lock()

    def transport(self, conn: Conn) -> Transport:
        """The one transport of the machine `conn` describes (made once, safe from threads);
        a host reached through another (a Slurm node, through its login node) shares that
        one's."""
        key = conn.machine_key()
        through = self.transport(conn.through) if conn.through is not None else None
        with self._lock:
            t = self._transports.get(key)
            if t is None:
                t = self._transports[key] = conn.open(
                    accept_new_host_keys=self.accept_new_host_keys, through=through)
            return t

    def transport_of(self, rec: HostRecord) -> Transport:
        return self.transport(rec.conn)

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

    def agent_argv(self, conn: Conn, *args: str) -> list[str]:
        """The agent command line; on remote hosts nebula_cli comes from the job's lib dir."""
        argv = [conn.python, "-m", "nebula_cli.agent", *args]
        if conn.pythonpath:
            return ["env", f"PYTHONPATH={conn.pythonpath}", *argv]
        return argv
