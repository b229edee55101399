"""A cluster's host in the spec: ``host``, ``user@host``, ``user@host:port`` or a mapping.

Re-exported by `nebula_cli.config.spec`; each field's default is defined here, once.
"""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from nebula_cli.config.fields import HostName, Interface, Port, UserName
from nebula_cli.config.sections import SpecModel

_HOST_RE = re.compile(
    r"(?:(?P<user>[^@\s:]+)@)?(?P<host>\[[^\]\s]+\]|[^@\s:\[\]]+)(?::(?P<port>\d+))?")
MAX_SLOTS = 1024
"""Most processes one host may start."""


class HostSpec(SpecModel):
    """One machine of a cluster; may be written as ``host``, ``user@host`` or ``user@host:port``."""

    host: HostName = Field(min_length=1)
    """Hostname, address or ~/.ssh/config alias; for transport local just a label."""
    user: UserName | None = None
    """SSH user. Default: ssh_config's, else the local user."""
    port: Port | None = None
    """SSH port (1..65535). Default: ssh_config's, else 22."""
    slots: int = Field(1, ge=1, le=MAX_SLOTS)
    """Processes started on this host (typically one per GPU)."""
    key: str | None = None
    """Private key file for SSH; ~ is expanded. Default: the agent / ssh_config keys."""
    address: HostName | None = None
    """Address the cluster's other hosts reach this one at (DeepSpeed master). Default: host."""
    interface: Interface | None = None
    """Network interface for GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME; overrides the cluster's."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        match = _HOST_RE.fullmatch(value.strip())
        if not match:
            raise ValueError(f"expected 'host', 'user@host' or 'user@host:port', found {value!r}")
        out: dict[str, Any] = {"host": match["host"].strip("[]")}
        if match["user"]:
            out["user"] = match["user"]
        if match["port"]:
            out["port"] = int(match["port"])
        return out

    @field_validator("key")
    @classmethod
    def _expand_key(cls, value: str | None) -> str | None:
        return None if value is None else os.path.expanduser(value)

    @property
    def reach_address(self) -> str:
        """The address other hosts of the cluster use for this one."""
        return self.address or self.host
