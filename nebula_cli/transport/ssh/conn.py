"""`SshConn`: a host reached over SSH (paramiko, imported only when a connection opens)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nebula_cli.transport.base import Transport
from nebula_cli.transport.conn import Conn, Load

DEFAULT_PYTHON = "python3"
"""The interpreter an SSH host's description names when its data names none."""
_OPTIONAL = ("home", "ssh_config", "known_hosts", "accept_new_host_keys", "connect_timeout")
"""Keys written only when set (tests and tools set them; the spec never does)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SshConn(Conn):
    """`user@host:port` (or an ssh_config alias), through the bastion `jump` if any."""

    kind = "ssh"
    _optional: ClassVar[tuple[str, ...]] = _OPTIONAL

    host: str | None = None
    """The address or ssh_config alias (None: the host's `name`)."""
    user: str | None = None
    port: int | None = None
    key: str | None = None
    """A private key file to offer (besides the agent's and ssh_config's)."""
    jump: str | None = None
    """A bastion: [user@]host[:port] or an ssh_config alias."""
    home: str | None = None
    """nebula's directory there (None: ~/.nebula)."""
    ssh_config: str | None = None
    known_hosts: str | None = None
    accept_new_host_keys: bool | None = None
    connect_timeout: float | None = None

    @classmethod
    def from_spec(cls, *, name: str, host: str | None, user: str | None, port: int | None,
                  key: str | None, jump: str | None, python: str, **_: Any) -> SshConn:
        """A spec's host of a `transport: ssh` cluster."""
        return cls(name=name, host=host or name, user=user, port=port, key=key, jump=jump,
                   python=python)

    def machine_key(self) -> tuple[Any, ...]:
        return (self.kind, self.user, self.host, self.port, self.jump)

    def _transport_args(self, accept_new_host_keys: bool) -> dict[str, Any]:
        """What an SSH transport of this host is made with (a kind's `open` adds its own)."""
        from nebula_cli.transport.ssh.transport import CONNECT_TIMEOUT

        return dict(user=self.user, port=self.port, key=self.key, jump=self.jump,
                    python=self.python, home=self.home or "~/.nebula",
                    ssh_config=self.ssh_config, known_hosts=self.known_hosts,
                    accept_new_host_keys=accept_new_host_keys
                    or bool(self.accept_new_host_keys),
                    connect_timeout=float(self.connect_timeout or CONNECT_TIMEOUT))

    def open(self, *, accept_new_host_keys: bool = False,
             through: Transport | None = None) -> Transport:
        from nebula_cli.transport.ssh.transport import SSHTransport  # paramiko on demand

        return SSHTransport(self.name, self.host, **self._transport_args(accept_new_host_keys))

    def to_data(self) -> dict[str, Any]:
        return {**self._common(), "host": self.host, "user": self.user, "port": self.port,
                "key": self.key, "jump": self.jump, "python": self.python,
                **self._pythonpath(),
                **{k: v for k in self._optional if (v := getattr(self, k)) is not None}}

    @classmethod
    def from_data(cls, data: Mapping[str, Any], load: Load) -> SshConn:
        return cls(name=data["name"], host=data.get("host"), user=data.get("user"),
                   port=data.get("port"), key=data.get("key"), jump=data.get("jump"),
                   python=data.get("python") or DEFAULT_PYTHON,
                   pythonpath=data.get("pythonpath"),
                   **{k: data[k] for k in cls._optional if data.get(k) is not None})


CONN = SshConn
"""This package's kind (`nebula_cli/transport/registry.py`)."""
