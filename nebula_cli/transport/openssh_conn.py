"""`OpensshConn`: a host reached with the user's own `ssh` and a master connection
(`transport: openssh`; the transport, `openssh.py`, is imported only when a connection
opens). For hosts that ask more than a key: a one-time code, Kerberos, a FIDO key."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nebula_cli.transport.base import Transport
from nebula_cli.transport.conn import Conn, Load
from nebula_cli.transport.ssh_conn import DEFAULT_PYTHON

_OPTIONAL = ("home", "ssh_config", "known_hosts", "accept_new_host_keys", "connect_timeout",
             "control_dir")
"""Keys written only when set (tests and tools set them; the spec never does)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpensshConn(Conn):
    """`user@host:port` (or an ssh_config alias) as the user's `ssh` reaches it."""

    kind = "openssh"

    host: str | None = None
    """The address or ssh_config alias (None: the host's `name`)."""
    user: str | None = None
    port: int | None = None
    key: str | None = None
    """A private key file (`ssh -i`, IdentitiesOnly); None: the agent's and ssh_config's."""
    jump: str | None = None
    """A bastion (`ssh -J`): [user@]host[:port] or an ssh_config alias."""
    home: str | None = None
    """nebula's directory there (None: ~/.nebula)."""
    ssh_config: str | None = None
    known_hosts: str | None = None
    accept_new_host_keys: bool | None = None
    connect_timeout: float | None = None
    control_dir: str | None = None
    """Where the master's socket is (None: `openssh.CONTROL_DIR`)."""

    @classmethod
    def from_spec(cls, *, name: str, host: str | None, user: str | None, port: int | None,
                  key: str | None, jump: str | None, python: str, **_: Any) -> OpensshConn:
        """A spec's host of a `transport: openssh` cluster."""
        return cls(name=name, host=host or name, user=user, port=port, key=key, jump=jump,
                   python=python)

    def machine_key(self) -> tuple[Any, ...]:
        return ("openssh", self.user, self.host, self.port, self.jump)

    def open(self, *, accept_new_host_keys: bool = False,
             through: Transport | None = None) -> Transport:
        from nebula_cli.transport.openssh import OpenSSHTransport
        from nebula_cli.transport.ssh import CONNECT_TIMEOUT

        return OpenSSHTransport(
            self.name, self.host, user=self.user, port=self.port, key=self.key,
            jump=self.jump, python=self.python, home=self.home or "~/.nebula",
            ssh_config=self.ssh_config, known_hosts=self.known_hosts,
            accept_new_host_keys=accept_new_host_keys or bool(self.accept_new_host_keys),
            connect_timeout=float(self.connect_timeout or CONNECT_TIMEOUT),
            control_dir=self.control_dir)

    def to_data(self) -> dict[str, Any]:
        return {**self._common(), "host": self.host, "user": self.user, "port": self.port,
                "key": self.key, "jump": self.jump, "python": self.python,
                **self._pythonpath(),
                **{k: v for k in _OPTIONAL if (v := getattr(self, k)) is not None}}

    @classmethod
    def from_data(cls, data: Mapping[str, Any], load: Load) -> OpensshConn:
        return cls(name=data["name"], host=data.get("host"), user=data.get("user"),
                   port=data.get("port"), key=data.get("key"), jump=data.get("jump"),
                   python=data.get("python") or DEFAULT_PYTHON,
                   pythonpath=data.get("pythonpath"),
                   **{k: data[k] for k in _OPTIONAL if data.get(k) is not None})
