"""`Conn`: how to reach a host, as a typed, frozen description that opens its `Transport`.

One subclass per transport kind (`local_conn`, `ssh_conn`, `slurmnode_conn`), each routed by
its `kind` in `transport.registry`. A description is plain data: the plan carries it, the state
store keeps it as JSON (`to_data`; the registry's `conn_from_data` reads it back, records made
by earlier versions included), and nothing connects until `open`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from nebula_cli.transport.base import Transport

Load = Callable[[Mapping[str, Any]], "Conn"]
"""Reads any kind's stored data (the registry's `conn_from_data`): for descriptions that hold
another one (a Slurm node's login node)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Conn(ABC):
    """How to reach one host. Equal descriptions reach the same host the same way."""

    kind: ClassVar[str]
    """The kind's name, stored as ``"transport"`` in the data (`to_data`)."""
    allocator: ClassVar[str | None] = None
    """The scheduler whose allocation the host is a node of (its allocator's name: what the
    host's record keeps that scheduler's word under), None for a host as the spec names it."""

    name: str
    """The host's name in the spec (what messages call it)."""
    python: str
    """The interpreter nebula's commands run under on the host."""
    pythonpath: str | None = None
    """Where nebula_cli is on the host when it was uploaded there (None: already importable)."""

    @property
    def in_allocation(self) -> bool:
        """The host is a node of a scheduler's allocation: it is gone once the allocation
        ends."""
        return self.allocator is not None

    @property
    def through(self) -> Conn | None:
        """The host this one is reached through, opened first (its transport is passed to
        `open`, so that one connection serves every host behind it); None for most kinds."""
        return None

    def with_pythonpath(self, path: str) -> Conn:
        """This description, with nebula_cli imported from `path` on the host."""
        return dataclasses.replace(self, pythonpath=path)

    @abstractmethod
    def machine_key(self) -> tuple[Any, ...]:
        """Hosts with the same key are the same machine (one connection serves them all)."""

    @abstractmethod
    def open(self, *, accept_new_host_keys: bool = False,
             through: Transport | None = None) -> Transport:
        """A transport to the host (lazy where the kind allows: nothing may connect yet).
        `through`: the opened transport of `self.through`, for kinds that have one."""

    @abstractmethod
    def to_data(self) -> dict[str, Any]:
        """Plain JSON data, the shape the state store has always kept: ``"transport"`` names
        the kind; keys with no value are left out unless the kind always wrote them."""

    @classmethod
    @abstractmethod
    def from_data(cls, data: Mapping[str, Any], load: Load) -> Conn:
        """The description `to_data` wrote (or an earlier version of nebula did)."""

    def _common(self) -> dict[str, Any]:
        """``"transport"`` and ``"name"``: the first keys of every kind's data."""
        return {"transport": self.kind, "name": self.name}

    def _pythonpath(self) -> dict[str, Any]:
        return {} if self.pythonpath is None else {"pythonpath": self.pythonpath}
