"""`OpensshConn`: a host reached with the user's own `ssh` and a master connection
(`transport: openssh`; the transport, `transport.py`, is imported only when a connection
opens). For hosts that ask more than a key: a one-time code, Kerberos, a FIDO key."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from nebula_cli.transport.base import Transport
from nebula_cli.transport.ssh.conn import SshConn


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpensshConn(SshConn):
    """`user@host:port` (or an ssh_config alias) as the user's `ssh` reaches it (`key`: `ssh
    -i`, IdentitiesOnly; `jump`: `ssh -J`). Stored and read as `SshConn` is, with its own kind
    and `control_dir`."""

    kind = "openssh"
    _optional: ClassVar[tuple[str, ...]] = (*SshConn._optional, "control_dir")

    control_dir: str | None = None
    """Where the master's socket is (None: `openssh.CONTROL_DIR`)."""

    def open(self, *, accept_new_host_keys: bool = False,
             through: Transport | None = None) -> Transport:
        from nebula_cli.transport.openssh.transport import OpenSSHTransport

        return OpenSSHTransport(self.name, self.host, **self._transport_args(accept_new_host_keys),
                                control_dir=self.control_dir)


CONN = OpensshConn
"""This package's kind (`nebula_cli/transport/registry.py`)."""
