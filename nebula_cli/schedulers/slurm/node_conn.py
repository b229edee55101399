"""`SlurmNodeConn`: a node of a running Slurm allocation, reached through its login node."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nebula_cli.schedulers.slurm.node_transport import SlurmNodeTransport
from nebula_cli.transport.base import Transport
from nebula_cli.transport.conn import Conn, Load


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmNodeConn(Conn):
    """Node `node` of Slurm job `job`, whose commands run as steps started on `login`."""

    kind = "slurm-node"
    allocator = "slurm"

    login: Conn
    """The cluster's login node (every node of the allocation shares its connection)."""
    job: str
    """The Slurm job id of the allocation."""
    node: str
    address: str
    """Where the node's peers reach it (Slurm's NodeAddr)."""
    keeper: str
    """The name the node's keeper serves under (`nebula_cli.agent.keeper`)."""

    @property
    def through(self) -> Conn:
        return self.login

    def machine_key(self) -> tuple[Any, ...]:
        return ("slurm-node", self.job, self.node, *self.login.machine_key())

    def open(self, *, accept_new_host_keys: bool = False,
             through: Transport | None = None) -> Transport:
        login = through if through is not None else self.login.open(
            accept_new_host_keys=accept_new_host_keys)
        return SlurmNodeTransport(self.name, login, job=self.job, node=self.node,
                                  address=self.address, keeper=self.keeper, python=self.python,
                                  pythonpath=self.pythonpath)

    def to_data(self) -> dict[str, Any]:
        return {**self._common(), "login": self.login.to_data(), "job": self.job,
                "node": self.node, "address": self.address, "keeper": self.keeper,
                "python": self.python, "pythonpath": self.pythonpath}

    @classmethod
    def from_data(cls, data: Mapping[str, Any], load: Load) -> SlurmNodeConn:
        return cls(name=data["name"], login=load(data["login"]), job=data["job"],
                   node=data["node"], address=data["address"], keeper=data["keeper"],
                   python=data["python"], pythonpath=data.get("pythonpath"))


CONN = SlurmNodeConn
"""The transport kind of a Slurm node (`nebula_cli.schedulers.registry`)."""
