"""Which relay dials which, and through what: the pure rule behind `relay_reach`.

A cluster's `relay_reach` says what its network lets through:

- ``inbound`` (default): other relays can open a TCP connection to its relay port (and it can
  dial out);
- ``outbound``: nothing reaches its relay port, but it can dial out;
- ``ssh``: its relay can neither be dialled nor dial out, but its host's sshd accepts
  connections (the usual firewall: only port 22 open).

The relays' order (`dial_order`): ``ssh`` clusters, then ``inbound``, then ``outbound`` ones
(those whose hosts nebula reaches over SSH before local ones), spec order within each. Each
cluster dials every cluster listed before it, so every pair has one dialler (`links`):

- to an ``inbound`` cluster, directly;
- to an ``ssh`` cluster, or from one ``outbound`` cluster to another, through an SSH tunnel:
  the dialler's relay host runs an ``ssh`` per connection to the dialled cluster's SSH host
  (`ClusterSpec.ssh_host`) with a key of the job whose forced command joins it to the dialled
  relay's port and may do nothing else; the relay dials the tunnel's local end. The mutual TLS
  inside is the same as on a direct link: the tunnel adds no trust (`nebula_cli.agent.tunnel`
  says what it trusts).

Pairs with no way to connect are spec problems (`problems`, exit 2): two ``ssh`` clusters
(neither can dial out), an ``ssh`` or tunnelled-to cluster whose sshd the other relays could
not reach (this machine, or only through a jump host without a `relay_address`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nebula_cli.config.yaml_positions import PathKey

if TYPE_CHECKING:
    from nebula_cli.config.cluster import ClusterSpec

_RANK = {"ssh": 0, "inbound": 1, "outbound": 2}


@dataclass(frozen=True)
class Link:
    """One relay-to-relay connection: `dialer` opens it to `dialled`, directly or through an
    SSH tunnel to the dialled cluster's SSH host."""

    dialer: str
    dialled: str
    tunnel: bool

    @property
    def key(self) -> str:
        """Names the link in the plan (tunnel keys, local ports): "dialer>dialled"."""
        return f"{self.dialer}>{self.dialled}"

    def __str__(self) -> str:
        return f"{self.dialer} dials {self.dialled}" + (
            " through an SSH tunnel" if self.tunnel else "")


def _key(cluster: ClusterSpec) -> tuple[int, bool]:
    rank = _RANK[cluster.relay_reach]
    # outbound clusters tunnel to each other: those with an sshd (transport ssh) are dialled
    return rank, rank == _RANK["outbound"] and not cluster.over_ssh


def dial_order(clusters: Sequence[ClusterSpec]) -> list[str]:
    """The clusters as their relays connect: each dials those before it."""
    return [c.name for c in sorted(clusters, key=_key)]


def links(clusters: Sequence[ClusterSpec]) -> list[Link]:
    """Every pair's connection, in dial order (dialler after dialled)."""
    by_name = {c.name: c for c in clusters}
    order = dial_order(clusters)
    return [Link(later, earlier, by_name[earlier].relay_reach != "inbound")
            for i, later in enumerate(order) for earlier in order[:i]]


def problems(clusters: Sequence[ClusterSpec]) -> list[tuple[PathKey, str]]:
    """Why some pair of relays could not connect (each at the `relay_reach` that causes it)."""
    index = {c.name: i for i, c in enumerate(clusters)}
    by_name = {c.name: c for c in clusters}
    found: list[tuple[PathKey, str]] = []
    ssh = [c for c in clusters if c.relay_reach == "ssh"]
    if len(ssh) > 1:
        found.append((("clusters", index[ssh[1].name], "relay_reach"), (
            f"{ssh[0].name} and {ssh[1].name} both have relay_reach: ssh: neither relay can dial "
            "out, so neither can reach the other; one of them must be able to dial out "
            "(inbound or outbound)")))
        return found
    tunnelled: dict[str, str] = {}
    for link in links(clusters):
        if link.tunnel:
            tunnelled.setdefault(link.dialled, link.dialer)
    for name, dialer in tunnelled.items():
        c = by_name[name]
        at: PathKey = ("clusters", index[name], "relay_reach")
        why = ("it has relay_reach: ssh" if c.relay_reach == "ssh" else
               f"{name} and {dialer} both have relay_reach: outbound")
        if not c.over_ssh:
            found.append((at, f"{why}, so {dialer}'s relay must reach {name}'s through an SSH "
                              f"tunnel to its host, but {name} runs on this machine (transport: "
                              "local); let one of them accept connections (relay_reach: "
                              "inbound)"))
        elif c.jump is not None and c.relay_address is None:
            found.append((at, f"{why}: {dialer}'s relay reaches {name}'s through an SSH tunnel "
                              f"to {c.ssh_host.host}, which nebula reaches only through the jump "
                              f"host {c.jump}; give relay_address: the address other clusters' "
                              f"hosts reach {c.ssh_host.host}'s sshd at"))
    return found
