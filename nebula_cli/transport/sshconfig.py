"""Where a host really is: the job spec's fields merged over ~/.ssh/config.

`resolve()` looks a host (name, address or `Host` alias) up with paramiko.SSHConfig and honours
HostName, User, Port, IdentityFile, IdentitiesOnly, ProxyJump and HostKeyAlias. A field given
explicitly (from the job spec) always wins over ssh_config, and ssh_config over the defaults
(port 22, the local user name).
"""

from __future__ import annotations

import getpass
import os
import re
from dataclasses import dataclass

import paramiko

from nebula_cli.errors import TransportError

DEFAULT_SSH_CONFIG = "~/.ssh/config"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
SSH_CONFIG_ENV = "NEBULA_SSH_CONFIG"
KNOWN_HOSTS_ENV = "NEBULA_KNOWN_HOSTS"

_DEST_RE = re.compile(
    r"(?:ssh://)?(?:(?P<user>[^@\s]+)@)?(?P<host>\[[^\]\s]+\]|[^@\s:\[\]]+)(?::(?P<port>\d+))?")


def default_ssh_config() -> str:
    """$NEBULA_SSH_CONFIG, else ~/.ssh/config (expanded)."""
    return os.path.expanduser(os.environ.get(SSH_CONFIG_ENV) or DEFAULT_SSH_CONFIG)


def default_known_hosts() -> str:
    """$NEBULA_KNOWN_HOSTS, else ~/.ssh/known_hosts (expanded)."""
    return os.path.expanduser(os.environ.get(KNOWN_HOSTS_ENV) or DEFAULT_KNOWN_HOSTS)


def load_ssh_config(path: str | None = None) -> paramiko.SSHConfig:
    """The parsed ssh_config at `path` (default: default_ssh_config()); missing -> empty."""
    path = os.path.expanduser(path) if path else default_ssh_config()
    if not os.path.exists(path):
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(path)
    except (OSError, paramiko.ConfigParseError, ValueError) as exc:
        raise TransportError(f"cannot read ssh config {path}: {exc}") from exc


def parse_destination(text: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` (also ``[v6addr]:port`` and ``ssh://...``) -> (user, host, port)."""
    match = _DEST_RE.fullmatch(text.strip())
    if not match:
        raise TransportError(f"not a host: {text!r} (expected [user@]host[:port])")
    port = int(match["port"]) if match["port"] else None
    if port is not None and not 0 < port < 65536:
        raise TransportError(f"port out of range in {text!r}")
    return match["user"], match["host"].strip("[]"), port


@dataclass(frozen=True)
class SSHTarget:
    """Everything needed to dial one host, after ssh_config and the spec were merged."""

    alias: str
    """What the user wrote (spec host or ssh_config alias)."""
    hostname: str
    """The name or address actually dialled (ssh_config HostName)."""
    port: int
    user: str
    identity_files: tuple[str, ...]
    """Explicit key, else ssh_config's IdentityFile entries (expanded)."""
    key_explicit: bool
    """The key came from the spec: only it is offered."""
    identities_only: bool
    jump: str | None
    """ProxyJump: comma-separated hops, first hop first; None for a direct connection."""
    host_key_alias: str | None

    @property
    def known_hosts_host(self) -> str:
        """The name this host's key is recorded under (HostKeyAlias, else HostName)."""
        return self.host_key_alias or self.hostname

    def __str__(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def resolve(
    host: str,
    *,
    user: str | None = None,
    port: int | None = None,
    key: str | None = None,
    jump: str | None = None,
    config: paramiko.SSHConfig | None = None,
    config_path: str | None = None,
) -> SSHTarget:
    """Merge explicit fields over ssh_config's entry for `host` (explicit fields win)."""
    if config is None:
        config = load_ssh_config(config_path)
    try:
        entry = config.lookup(host)
    except Exception as exc:  # paramiko raises assorted errors for bad Match/tokens
        raise TransportError(f"cannot look {host!r} up in ssh config: {exc}") from exc
    if port is None and entry.get("port"):
        try:
            port = int(entry["port"])
        except ValueError as exc:
            raise TransportError(f"bad Port {entry['port']!r} for {host} in ssh config") from exc
    if key:
        identity_files: tuple[str, ...] = (os.path.expanduser(key),)
    else:
        identity_files = tuple(os.path.expanduser(p) for p in entry.get("identityfile", []))
    if jump is None:
        jump = entry.get("proxyjump")
    if jump is not None and jump.strip().lower() in ("", "none"):
        jump = None
    return SSHTarget(
        alias=host,
        hostname=entry.get("hostname") or host,
        port=port or 22,
        user=user or entry.get("user") or getpass.getuser(),
        identity_files=identity_files,
        key_explicit=bool(key),
        identities_only=bool(key) or entry.get("identitiesonly", "no").lower() == "yes",
        jump=jump.strip() if jump else None,
        host_key_alias=entry.get("hostkeyalias"),
    )
