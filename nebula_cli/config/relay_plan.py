"""The relays' part of the job plan: one relay agent per cluster (relay.json, its certificates),
and, for pairs of clusters whose relays meet through an SSH tunnel (`reach`), the tunnels
(tunnels.json, a key per tunnel, the SSH host's pinned key).
"""

from __future__ import annotations

import datetime as dt
import posixpath

from nebula_cli.config import strict
from nebula_cli.config.cluster import ClusterSpec
from nebula_cli.config.hosts import HostSpec
from nebula_cli.config.parts import AgentConfig, ProcessConfig
from nebula_cli.config.plan_model import (
    RELAY,
    RELAY_GRACE,
    RELAY_RESTART_BACKOFF,
    RELAY_RESTARTS,
    WORKER_SOCKET,
    AgentPlan,
    Certs,
    Ports,
    Site,
    agent_dir,
    base_env,
    cert_names,
    conn_of,
    job_root_of,
    tls_files,
)
from nebula_cli.config.reach import Link
from nebula_cli.config.relay_config import AutoCodec, AutoSteps, RelayConfig, ShapingConfig
from nebula_cli.config.spec import JobSpec
from nebula_cli.config.tunnel_config import (
    TUNNELS_FILE,
    TunnelConfig,
    TunnelDial,
    TunnelGrant,
    job_tag,
)
from nebula_cli.config.worlds import site_key

TUNNEL_KEEPALIVE = 5
"""Seconds between a tunnel's SSH keepalives (ServerAliveInterval)."""
TUNNEL_KEEPALIVE_COUNT = 3
"""Keepalives unanswered before a tunnel is given up and restarted (15 s of silence)."""
TUNNEL_GRANT_TTL = 900
"""Seconds a tunnel key's authorized_keys line stays valid unless its relay renews it (every
third of that while it runs): how long a killed relay's key outlives it at most."""


def _gateway_site(cluster: ClusterSpec, sites: dict[str, Site]) -> Site:
    return sites[site_key(cluster, cluster.gateway_host)]


def dial_address(cluster: ClusterSpec, sites: dict[str, Site]) -> str:
    """The address other clusters dial the cluster's relay services at: its `relay_address`,
    else what its gateway host's transport reported."""
    return cluster.relay_address or _gateway_site(cluster, sites).address


def relay_addr(spec: JobSpec, cluster: ClusterSpec, sites: dict[str, Site],
                ports: Ports) -> str:
    """host:port where the cluster's workers reach their relay."""
    return f"{_gateway_site(cluster, sites).address}:{ports.relays[cluster.name][1]}"


def relay_socket(job_root: str, cluster: ClusterSpec, host: HostSpec) -> str | None:
    """The Unix socket where workers on `host` reach their relay without TLS when `host` runs
    it (the cluster's gateway; `job_root`: the job's directory there), else None."""
    gateway = cluster.gateway_host.host
    return (posixpath.join(agent_dir(job_root, cluster.name, gateway, RELAY), WORKER_SOCKET)
            if host.host == gateway else None)


def auto_steps(spec: JobSpec) -> AutoSteps | None:
    """How the relays choose H with ``inner_steps: auto`` (None: a fixed H, or time-based)."""
    sync = spec.relay.sync if spec.relay is not None else None
    if sync is None or not sync.auto:
        return None
    return AutoSteps(target_utilization=sync.target_utilization,
                     min_steps=sync.min_inner_steps, max_steps=sync.max_inner_steps,
                     overlap=sync.overlap)


def auto_codec(spec: JobSpec) -> AutoCodec | None:
    """How the relays choose each round's codec with ``compression: auto`` (None: one codec)."""
    relay = spec.relay
    if relay is None or len(relay.compression.codecs) < 2:
        return None
    sync = relay.sync
    return AutoCodec(codecs=list(relay.compression.codecs),
                     target_utilization=sync.target_utilization, overlap=sync.overlap,
                     budget_steps=None if sync.auto or sync.every is not None
                     else sync.first_inner_steps,
                     budget_s=sync.every)


def relay_agents(spec: JobSpec, job_id: str, sites: dict[str, Site], ports: Ports,
                  certs: Certs | None) -> list[AgentPlan]:
    """One relay agent per averaging cluster (not a teacher's), on its gateway, with relay.json
    and its certificates."""
    if spec.relay is None:
        return []
    assert certs is not None  # build_plan's contract
    plans = []
    for cluster in (c for c in spec.clusters if c.averages):
        gateway = cluster.gateway_host
        site = _gateway_site(cluster, sites)
        job_root = job_root_of(site, job_id)
        adir = agent_dir(job_root, cluster.name, gateway.host, RELAY)
        names = [h.host for h in cluster.hosts]  # a login node's relay (-1) comes first
        node_rank = names.index(gateway.host) if gateway.host in names else -1
        env = {"NEBULA_JOB_ID": job_id, "NEBULA_CLUSTER": cluster.name,
               "NEBULA_HOST": gateway.host, **base_env(site, job_root)}
        tunnels, tunnel_files = tunnel_config(spec, job_id, cluster, adir, sites, ports, certs)
        argv = [site.python, "-m", "nebula_cli.relay", "--config",
                posixpath.join(adir, "relay.json")]
        if tunnels is not None:  # the relay runs inside the keeper of its tunnels
            argv = [site.python, "-m", "nebula_cli.agent.tunnel", "run", "--config",
                    posixpath.join(adir, TUNNELS_FILE), "--", *argv]
            tunnel_files[TUNNELS_FILE] = strict.dumps(tunnels)
        config = AgentConfig(
            job_id=job_id, cluster=cluster.name, host=gateway.host, role=RELAY, cwd=adir,
            grace=RELAY_GRACE, max_restarts=max(spec.max_restarts, RELAY_RESTARTS),
            restart_backoff=RELAY_RESTART_BACKOFF,
            processes=[ProcessConfig(name="relay", argv=argv, env=env, log="logs/relay.log",
                                     metrics="metrics/relay.jsonl")],
            rotation=spec.logs.rotation(), world_secret="")  # a relay is in no world
        cert, key = certs.relays[cluster.name]
        relay_json = relay_config(spec, job_id, cluster, adir, ports, sites)
        files = {"relay.json": strict.dumps(relay_json),
                 **dict(zip(cert_names(RELAY), (certs.ca, cert, key), strict=True)),
                 **tunnel_files}
        plans.append(AgentPlan(
            cluster=cluster.name, host=gateway.host, role=RELAY, node_rank=node_rank, slots=1,
            conn=conn_of(site, job_root), job_root=job_root, config=config, files=files))
    return plans


def relay_config(spec: JobSpec, job_id: str, cluster: ClusterSpec, adir: str, ports: Ports,
                 sites: dict[str, Site]) -> RelayConfig:
    """The relay's part of the plan (relay.json) for `cluster`."""
    relay = spec.relay
    assert relay is not None

    by_name = {c.name: c for c in spec.clusters}
    tunnelled = {link.dialled: tunnel_socket(adir, link.dialled) for link in spec.links()
                 if link.dialer == cluster.name and link.tunnel}
    site = _gateway_site(cluster, sites)
    dialled_by = [link for link in spec.links() if link.dialled == cluster.name]
    # dialled only through tunnels that end on this host: the peer port is not on the network
    bind = "127.0.0.1" if dialled_by and all(link.tunnel for link in dialled_by) and \
        _relay_on_ssh_host(cluster) else site.bind
    peer_port, worker_port = ports.relays[cluster.name]
    shaping = relay.shaping
    return RelayConfig(
        job_id=job_id,
        cluster=cluster.name,
        clusters=[n for n in spec.dial_order if by_name[n].averages],
        peer_listen=f"{bind}:{peer_port}",
        worker_listen=f"{site.bind}:{worker_port}",
        worker_socket=posixpath.join(adir, WORKER_SOCKET),
        peers={c.name: tunnelled.get(c.name)
               or f"{dial_address(c, sites)}:{ports.relays[c.name][0]}"
               for c in spec.clusters if c.name != cluster.name and c.averages},
        tls=tls_files(adir, RELAY),
        codec=relay.compression.codec,
        error_feedback=relay.compression.error_feedback,
        feedback_decay=relay.compression.decays,
        codec_params=relay.compression.params,
        auto_steps=auto_steps(spec), auto_codec=auto_codec(spec), round_timeout=relay.timeout,
        heartbeat=relay.heartbeat, dead_after=relay.dead_after,
        shaping=ShapingConfig(rate_mbit=shaping.rate_mbit if shaping else None,
                              delay_ms=shaping.delay_ms if shaping else 0.0),
        status_file=posixpath.join(adir, "relay-status.json"),
        metrics_file=posixpath.join(adir, "metrics", "relay.jsonl"),
    )


# -- SSH tunnels ------------------------------------------------------------------------------
def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _relay_on_ssh_host(cluster: ClusterSpec) -> bool:
    return site_key(cluster, cluster.gateway_host) == site_key(cluster, cluster.ssh_host)


def tunnel_socket(adir: str, peer: str) -> str:
    """The local end of the dialling relay's tunnel to `peer`: a Unix socket file in its agent
    folder (`agent.tunnel` makes the folder 0700; only the job's user reaches it)."""
    return posixpath.join(adir, "tunnels", f"{peer}.sock")


def tunnel_target(cluster: ClusterSpec, sites: dict[str, Site], ports: Ports) -> str:
    """The relay's peer port as its cluster's SSH host sees it: the only place a tunnel key's
    forced command joins it to (loopback when the relay runs on that host)."""
    host = "127.0.0.1" if _relay_on_ssh_host(cluster) else _gateway_site(cluster, sites).address
    return _host_port(host, ports.relays[cluster.name][0])


def tunnel_links(spec: JobSpec) -> list[Link]:
    """The links that ride an SSH tunnel (each needs a key)."""
    return [link for link in spec.links() if link.tunnel]


def expires_at(certs: Certs) -> int:
    """Unix time after which a tunnel key is refused whatever happens: the certificates' end
    (certificates without one: a year)."""
    end = certs.expires or dt.datetime.now(dt.UTC) + dt.timedelta(days=365)
    return int(end.timestamp())


def tunnel_config(spec: JobSpec, job_id: str, cluster: ClusterSpec, adir: str,
                  sites: dict[str, Site], ports: Ports, certs: Certs
                  ) -> tuple[TunnelConfig | None, dict[str, bytes]]:
    """A relay's tunnels.json (None when it has no tunnel) and the files beside it: a private
    key per tunnel it opens, the pinned host keys of their SSH hosts."""
    by_name = {c.name: c for c in spec.clusters}
    dial, grant, files, pins = [], [], {}, []
    for link in tunnel_links(spec):
        private, public = certs.tunnel_keys[link.key]
        if link.dialer == cluster.name:
            peer = by_name[link.dialled]
            ssh = sites[site_key(peer, peer.ssh_host)]
            assert ssh.ssh is not None, f"{peer.name}: no SSH login (reach.problems refuses it)"
            alias = f"nebula-{job_id}-{peer.name}"
            pins.append(f"{alias} {ssh.ssh.host_key}\n")
            files[f"tunnels/{peer.name}.key"] = private
            dial.append(TunnelDial(
                peer=peer.name, listen=tunnel_socket(adir, peer.name),
                target=tunnel_target(peer, sites, ports), host=peer.relay_address or ssh.address,
                port=ssh.ssh.port, user=ssh.ssh.user,
                key=posixpath.join(adir, f"tunnels/{peer.name}.key"),
                known_hosts=posixpath.join(adir, "tunnels/known_hosts"), alias=alias,
                log=posixpath.join(adir, f"logs/tunnel-{peer.name}.log")))
        elif link.dialled == cluster.name:
            tag = f"{job_tag(job_id)}{link.key}"
            grant.append(TunnelGrant(
                peer=link.dialer, authorized_keys=cluster.authorized_keys, public_key=public,
                targets=[tunnel_target(cluster, sites, ports)], expires=expires_at(certs),
                tag=tag))
    if not dial and not grant:
        return None, {}
    if pins:
        files["tunnels/known_hosts"] = "".join(pins).encode()
    return TunnelConfig(job_id=job_id, cluster=cluster.name, keepalive=TUNNEL_KEEPALIVE,
                        keepalive_count=TUNNEL_KEEPALIVE_COUNT, grant_ttl=TUNNEL_GRANT_TTL,
                        dial=dial, grant=grant), files
