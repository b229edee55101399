"""`LocalConn`: a host that is this machine (processes run as its subprocesses)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nebula_cli.transport.base import Transport
from nebula_cli.transport.conn import Conn, Load
from nebula_cli.transport.local.transport import LocalTransport, local_python


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalConn(Conn):
    """This machine, with nebula's directory at `home`."""

    kind = "local"

    home: str
    """nebula's directory (the launching machine's `$NEBULA_HOME`)."""

    @classmethod
    def from_spec(cls, *, name: str, home: str, python: str, **_: Any) -> LocalConn:
        """A spec's host of a `transport: local` cluster (sys.executable unless the spec
        names an interpreter)."""
        return cls(name=name, home=home, python=local_python(python))

    def machine_key(self) -> tuple[Any, ...]:
        return ("local", self.home)

    def open(self, *, accept_new_host_keys: bool = False,
             through: Transport | None = None) -> Transport:
        return LocalTransport(self.name, home=self.home, python=self.python)

    def to_data(self) -> dict[str, Any]:
        return {**self._common(), "home": self.home, "python": self.python,
                **self._pythonpath()}

    @classmethod
    def from_data(cls, data: Mapping[str, Any], load: Load) -> LocalConn:
        python = data.get("python")
        return cls(name=data["name"], home=data["home"],
                   python=python if python is not None else local_python(None),
                   pythonpath=data.get("pythonpath"))


CONN = LocalConn
"""This package's kind (`nebula_cli/transport/registry.py`)."""
