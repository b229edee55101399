"""bench-network over the relays' SSH tunnels: a pair of clusters whose relays meet through a
tunnel (`reach`) is measured through one, made as the job's are (`config.relay_plan`,
`agent.tunnel`).

For such a pair, the dialled host's probe server listens on two known ports (TLS, plain); a
throwaway key of the run is let in there for those two ports only (`tunnel grant`: its forced
command joins a session to either port and nothing else, for the job's tunnels' grant period
and one pair's measurement, written again between pairs as the period runs out (`Bench.renew`);
`tunnel revoke` at cleanup, before the run's directory goes), and the measurer on the dialling
host runs inside `tunnel run` with two local ends (Unix socket files in the run's directory
there, as a job's relay has: an ssh per connection, one to each port).
"""

from __future__ import annotations

import datetime as dt
import posixpath
from dataclasses import dataclass

from nebula_cli import pki
from nebula_cli.config import strict
from nebula_cli.config.relay_plan import (
    TUNNEL_GRANT_TTL,
    TUNNEL_KEEPALIVE,
    TUNNEL_KEEPALIVE_COUNT,
)
from nebula_cli.config.tunnel_config import TunnelConfig, TunnelDial, TunnelGrant, job_tag
from nebula_cli.transport import Transport

TUNNEL_FILES = ("agent/__init__.py", "agent/authkeys.py", "agent/bridge.py", "agent/grants.py",
                "agent/tunnel.py", "agent/unix_socket.py",
                "config/__init__.py", "config/strict.py", "config/tunnel_config.py")
"""What `python -m nebula_cli.agent.tunnel` imports (beside errors.py)."""
TUNNEL_MODULE = "nebula_cli.agent.tunnel"
WAIT = 20.0
"""Seconds the measurer retries refused connections while its tunnels come up."""


@dataclass(frozen=True)
class BenchTunnel:
    """The tunnel of one pair: the dialled host's probe ports and the dialler's local ends."""

    dialer: str
    """The dialling cluster."""
    dialled: str
    ports: tuple[int, int]
    """The probe server's TLS and plain ports on the dialled host."""
    host: str
    """The dialled host's sshd, as the dialler reaches it (address, port, user, key)."""
    port: int
    user: str
    host_key: str
    key: tuple[bytes, str]

    @property
    def tag(self) -> str:
        return f"{self.dialer}>{self.dialled}"


def grant_config(run: str, cluster: str, authorized_keys: str, tunnels: list[BenchTunnel],
                 expires: dt.datetime) -> TunnelConfig:
    """The dialled host's part: one key line per tunnel to it, for its two probe ports."""
    grants = []
    for t in tunnels:
        tag = f"{job_tag(run)}{t.tag}"
        targets = [f"127.0.0.1:{port}" for port in t.ports]
        grants.append(TunnelGrant(peer=t.dialer, authorized_keys=authorized_keys, tag=tag,
                                  public_key=t.key[1], targets=targets,
                                  expires=int(expires.timestamp())))
    return TunnelConfig(job_id=run, cluster=cluster, keepalive=TUNNEL_KEEPALIVE,
                        keepalive_count=TUNNEL_KEEPALIVE_COUNT, grant_ttl=TUNNEL_GRANT_TTL,
                        dial=[], grant=grants)


WAYS = ("tls", "plain")
"""The probe server's two ports, in `BenchTunnel.ports`' order."""


def local_end(t: BenchTunnel, where: str, which: str) -> str:
    """The local end of `t` to the server's `which` port: a socket file in `where`."""
    return posixpath.join(where, f"tunnel-{t.dialled}-{which}.sock")


def dial_files(run: str, t: BenchTunnel, where: str) -> dict[str, bytes]:
    """The dialling host's files under `where`: tunnels-<dialled>.json, its key, the pin."""
    name = f"tunnel-{t.dialled}"
    alias = f"nebula-{run}-{t.dialled}"
    dials = [TunnelDial(peer=t.dialled, listen=local_end(t, where, which),
                        target=f"127.0.0.1:{port}", host=t.host, port=t.port, user=t.user,
                        key=posixpath.join(where, f"{name}.key"),
                        known_hosts=posixpath.join(where, f"{name}.known_hosts"), alias=alias,
                        log=posixpath.join(where, f"{name}-{which}.log"))
             for which, port in zip(WAYS, t.ports, strict=True)]
    cfg = TunnelConfig(job_id=run, cluster=t.dialer, keepalive=TUNNEL_KEEPALIVE,
                       keepalive_count=TUNNEL_KEEPALIVE_COUNT, grant_ttl=TUNNEL_GRANT_TTL,
                       dial=dials, grant=[])
    return {f"{name}.json": strict.dumps(cfg), f"{name}.key": t.key[0],
            f"{name}.known_hosts": f"{alias} {t.host_key}\n".encode()}


def wrap(python: str, where: str, t: BenchTunnel, measure: list[str]) -> list[str]:
    """The measurer's command inside the tunnel keeper, dialling the tunnel's local ends."""
    return [python, "-m", TUNNEL_MODULE, "run", "--config",
            posixpath.join(where, f"tunnel-{t.dialled}.json"), "--", *measure,
            "--tls-socket", local_end(t, where, "tls"),
            "--plain-socket", local_end(t, where, "plain"), "--wait", f"{WAIT:g}"]


def new_tunnel(dialer: str, dialled: str, *, server: Transport, address: str,
               ports: tuple[int, int]) -> BenchTunnel:
    """The tunnel to the probe server's `ports`: the server's sshd as nebula reached it, and a
    new key."""
    login = server.ssh_login()
    assert login is not None, f"{dialled}: no sshd (reach.problems refuses such a spec)"
    user, ssh_port, host_key = login
    return BenchTunnel(dialer=dialer, dialled=dialled, ports=ports, host=address, port=ssh_port,
                       user=user, host_key=host_key, key=pki.ssh_keypair())


def two_free_ports(t: Transport) -> tuple[int, int]:
    """Two different ports free on the host."""
    first = t.listen_port(None)
    second = t.listen_port(None)
    while second == first:
        second = t.listen_port(None)
    return first, second
