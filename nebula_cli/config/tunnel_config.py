"""TunnelConfig: the SSH tunnels of one relay, its part of the job plan (tunnels.json, 0600).

Written beside relay.json when the relay meets a peer through an SSH tunnel (`reach`); loaded
strictly by `nebula_cli.agent.tunnel`, which runs the relay with its tunnels. Standard library
only. No field has a default: the plan fills every value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nebula_cli.config import strict

TUNNELS_FILE = "tunnels.json"
"""Its name in the relay's agent directory."""
TAG_PREFIX = "nebula-tunnel:"
"""Every authorized_keys line nebula adds ends with the comment TAG_PREFIX + "<job id>:<link>"."""


def job_tag(job_id: str) -> str:
    """The start of the comment of every authorized_keys line of a job."""
    return f"{TAG_PREFIX}{job_id}:"


@dataclass(frozen=True)
class TunnelDial:
    """A tunnel this relay's host keeps: a local end whose every connection rides its own
    ``ssh HOST TARGET`` to the SSH host of the cluster it dials (whose key's forced command
    joins it to `target`), authenticated by `key`, the host's key pinned in `known_hosts`."""

    peer: str
    """The cluster this relay dials through the tunnel."""
    listen: str
    """The local end the relay dials for `peer`: the absolute path of a Unix socket file (in
    the relay's agent folder; bench-network's: in the run's directory), reached by this
    user's processes only."""
    target: str
    """host:port of the peer's relay as its SSH host sees it: all the key may reach."""
    host: str
    """The peer's SSH host (address)."""
    port: int
    user: str
    key: str
    """The tunnel's private key (a 0600 file of the plan)."""
    known_hosts: str
    """A known_hosts file holding the SSH host's key under `alias` (what nebula verified)."""
    alias: str
    """The name the host key is pinned under (ssh's HostKeyAlias)."""
    log: str
    """Where ssh's own messages go (its last line is repeated in the relay's log)."""


@dataclass(frozen=True)
class TunnelGrant:
    """A key this relay's host lets in for as long as the relay runs: one authorized_keys line
    (`nebula_cli.agent.grants`) whose forced command joins the session to one of `targets`,
    with no forwarding, shell or pty, valid `TunnelConfig.grant_ttl` seconds at a time."""

    peer: str
    """The cluster whose relay dials through it."""
    authorized_keys: str
    """The sshd's key file for this user (~ is the home directory)."""
    public_key: str
    """"ssh-ed25519 <base64>" of the tunnel's key."""
    targets: list[str]
    """host:port the key may reach (the relay's peer port as this host sees it)."""
    expires: int
    """Unix time after which the key is refused whatever happens (the certificates' end)."""
    tag: str
    """The line's comment: names the job and the tunnel (`job_tag`)."""


@dataclass(frozen=True)
class TunnelConfig:
    """tunnels.json: what `nebula_cli.agent.tunnel run` sets up around the relay."""

    job_id: str
    cluster: str
    keepalive: int
    """Seconds between ssh's keepalives (ServerAliveInterval) on an idle tunnel."""
    keepalive_count: int
    """Keepalives unanswered before ssh gives a connection up (the relay dials again)."""
    grant_ttl: int
    """Seconds a grant's line stays valid unless renewed (`run` renews it while the relay
    runs, so a killed relay's key is refused soon after even if no one removes it)."""
    dial: list[TunnelDial]
    grant: list[TunnelGrant]

    @classmethod
    def load(cls, path: str | Path) -> TunnelConfig:
        return strict.load(cls, path)
