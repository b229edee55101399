"""Where a host really is: the job spec's fields merged over the user's ssh_config.

`resolve()` looks a host (name, address or `Host` alias) up as the user's `ssh` does: with
`ssh -G` where OpenSSH's client is installed (`openssh_config.py`: Include, Match, wildcards,
tokens, CanonicalizeHostname, all as OpenSSH reads them), else with paramiko's parser. It
keeps HostName, User, Port, IdentityFile, CertificateFile, IdentitiesOnly, ProxyJump,
ProxyCommand, HostKeyAlias, UserKnownHostsFile, GlobalKnownHostsFile and HashKnownHosts. A
field given explicitly (from the job spec) always wins over ssh_config, and ssh_config over
the defaults (port 22, the local user name).
"""

from __future__ import annotations

import getpass
import os
import re
from dataclasses import dataclass

import paramiko

from nebula_cli.errors import TransportError
from nebula_cli.transport import openssh_config

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
    certificate_files: tuple[str, ...] = ()
    """ssh_config's CertificateFile entries (expanded); `<key>-cert.pub` is found besides."""
    proxy_command: str | None = None
    """ProxyCommand, its tokens expanded: a shell command whose stdin/stdout is the link."""
    known_hosts_files: tuple[str, ...] = ()
    """UserKnownHostsFile (expanded; the first is written): empty: nebula's default."""
    global_known_hosts_files: tuple[str, ...] = ()
    """GlobalKnownHostsFile (read only); empty: /etc/ssh/ssh_known_hosts."""
    hash_known_hosts: bool = False
    """HashKnownHosts: a key recorded with accept-new is written under a hashed name."""
    resolved_by: str = "paramiko"
    """Who read ssh_config: ``"ssh -G"`` (the user's OpenSSH) or ``"paramiko"``."""
    config_file: str | None = None
    """The ssh_config file named (None: the user's and the system's, as `ssh` reads them)."""
    applied: tuple[str, ...] = ()
    """The ssh_config blocks that applied, ``file:line (pattern)`` (known with `ssh -G`)."""

    def describe(self) -> str:
        """How this host is reached, for `validate --hosts`: where, through what, from which
        lines of ssh_config."""
        via = (f" via ProxyJump {self.jump}" if self.jump else
               f" via ProxyCommand `{self.proxy_command}`" if self.proxy_command else "")
        cert = " (certificates: " + ", ".join(self.certificate_files) + ")" \
            if self.certificate_files else ""
        source = (f"; ssh_config read by {self.resolved_by}"
                  + (f" from {self.config_file}" if self.config_file else "")
                  + (": " + ", ".join(self.applied) if self.applied else ""))
        return f"{self}{via}{cert}{source}"

    @property
    def known_hosts_host(self) -> str:
        """The name this host's key is recorded under (HostKeyAlias, else HostName)."""
        return self.host_key_alias or self.hostname

    def __str__(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def _no_jump(value: str | None) -> str | None:
    if value is None or value.strip().lower() in ("", "none"):
        return None
    return value.strip()


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
    """Merge explicit fields over ssh_config's entry for `host` (explicit fields win).
    `config_path` None: $NEBULA_SSH_CONFIG if set, else the files `ssh` reads by itself.
    With OpenSSH's client installed (and no parsed `config` passed) `ssh -G` reads them."""
    if config_path is None and os.environ.get(SSH_CONFIG_ENV):
        config_path = os.path.expanduser(os.environ[SSH_CONFIG_ENV])
    if config is None and openssh_config.ssh_binary() is not None:
        return _resolve_openssh(host, user=user, port=port, key=key, jump=jump,
                                config_path=config_path)
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
    jump = _no_jump(jump if jump is not None else entry.get("proxyjump"))
    return SSHTarget(
        alias=host,
        hostname=entry.get("hostname") or host,
        port=port or 22,
        user=user or entry.get("user") or getpass.getuser(),
        identity_files=identity_files,
        key_explicit=bool(key),
        identities_only=bool(key) or entry.get("identitiesonly", "no").lower() == "yes",
        jump=jump,
        host_key_alias=entry.get("hostkeyalias"),
        proxy_command=None if jump else _no_jump(entry.get("proxycommand")),
        config_file=config_path,
    )


def _resolve_openssh(host: str, *, user: str | None, port: int | None, key: str | None,
                     jump: str | None, config_path: str | None) -> SSHTarget:
    """`resolve` through `ssh -G`: explicit fields passed on (so `Match user` sees them) and
    kept over what it prints."""
    found = openssh_config.ssh_g(host, config_path=config_path, user=user, port=port)
    opts = found.options

    def one(name: str, default: str | None = None) -> str | None:
        values = opts.get(name)
        return values[0] if values else default

    hostname = one("hostname") or host
    try:
        port = port or int(one("port") or 22)
    except ValueError as exc:
        raise TransportError(f"bad Port {one('port')!r} for {host} in ssh config") from exc
    user = user or one("user") or getpass.getuser()
    alias = one("hostkeyalias")

    def expand(text: str) -> str:
        return openssh_config.expand_tokens(text, host=host, hostname=hostname, port=port,
                                            user=user, extra={"k": alias or hostname})

    listed = opts.get("identityfile", [])
    if key:
        identity_files: tuple[str, ...] = (os.path.expanduser(key),)
    elif set(listed) <= openssh_config.DEFAULT_IDENTITY_FILES:
        identity_files = ()  # OpenSSH's defaults: tried after the agent, as before
    else:
        identity_files = tuple(dict.fromkeys(expand(p) for p in listed))
    jump = _no_jump(jump if jump is not None else one("proxyjump"))
    proxy = None if jump else _no_jump(one("proxycommand"))
    return SSHTarget(
        alias=host,
        hostname=hostname,
        port=port,
        user=user,
        identity_files=identity_files,
        key_explicit=bool(key),
        identities_only=bool(key) or (one("identitiesonly", "no") or "").lower() == "yes",
        jump=jump,
        host_key_alias=alias,
        certificate_files=tuple(expand(p) for p in opts.get("certificatefile", [])),
        proxy_command=expand(proxy) if proxy else None,
        known_hosts_files=tuple(expand(p) for v in opts.get("userknownhostsfile", [])
                                for p in v.split()),
        global_known_hosts_files=tuple(expand(p) for v in opts.get("globalknownhostsfile", [])
                                       for p in v.split()),
        hash_known_hosts=(one("hashknownhosts", "no") or "").lower() == "yes",
        resolved_by="ssh -G",
        config_file=config_path,
        applied=found.applied,
    )
