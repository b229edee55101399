"""What the plan needs from the hosts, asked of their transports: `HostFacts` (a part of the
orchestrator) learns each host's site (directories, addresses, python, its sshd), the
interfaces of multi-host worlds, free ports (the relays', the teachers' label relays), issues
the job's certificates and tunnel keys, then calls the pure `jobplan.build_plan`."""

from __future__ import annotations

import dataclasses
import datetime as dt
import secrets

from nebula_cli import pki
from nebula_cli.config import jobplan, plan_model, worlds
from nebula_cli.config.distill_plan import labels_port
from nebula_cli.config.relay_plan import tunnel_links
from nebula_cli.config.spec import ClusterSpec, HostSpec, JobSpec
from nebula_cli.control.fanout import fanout
from nebula_cli.control.hostcheck import require_python
from nebula_cli.control.session import Session
from nebula_cli.transport import Conn, describe

AGENT_TIMEOUT = 60.0
"""Seconds a quick call to every host (a site, a port, an agent started) may take."""


def describe_host(cluster: ClusterSpec, host: HostSpec, home: str) -> Conn:
    """The spec's way to reach `host` (its cluster's `transport:`)."""
    return describe(cluster.transport, name=host.host, home=home, host=host.host,
                    user=host.user, port=host.port, key=host.key, jump=cluster.jump,
                    python=cluster.python)


def site_entries(spec: JobSpec) -> dict[str, tuple[ClusterSpec, HostSpec]]:
    """Every host the plan needs a site of: the clusters' hosts, and the hosts of relays and
    of tunnels' SSH ends not among them (a Slurm cluster's login node)."""
    entries = {worlds.site_key(c, h): (c, h) for c in spec.clusters for h in c.hosts}
    for c in spec.clusters:
        for h in (c.gateway_host, c.ssh_host):
            entries.setdefault(worlds.site_key(c, h), (c, h))
    return entries


class HostFacts:
    """The plan's inputs, learnt from the hosts through `session` (see the module docstring)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.store = session.store

    def sites(self, spec: JobSpec, conns: dict[str, Conn] | None = None
              ) -> dict[str, plan_model.Site]:
        """What every host's transport reports (connecting to remote hosts to learn it);
        `conns`: how to reach hosts the spec does not say (a Slurm allocation's nodes)."""
        home = str(self.store.home)
        entries = site_entries(spec)
        ends = {worlds.site_key(c, c.ssh_host) for link in tunnel_links(spec)
                for c in spec.clusters if c.name == link.dialled}

        def site(key: str) -> plan_model.Site:
            cluster, host = entries[key]
            conn = (conns or {}).get(key) or describe_host(cluster, host, home)
            t = self.session.transport(conn)
            require_python(t, cluster.name, host.host)
            login = t.ssh_login() if key in ends else None
            return plan_model.Site(conn=conn, home=t.home, address=host.address or t.address,
                                bind=t.bind_address, python=t.python,
                                shares_files=t.shares_files,
                                ssh=plan_model.SshLogin(*login) if login else None)

        return fanout(list(entries), site, timeout=AGENT_TIMEOUT, cancel=self.session.abort)

    def routes(self, spec: JobSpec, sites: dict[str, plan_model.Site]
               ) -> dict[str, plan_model.Site]:
        """The sites, with the interface each host of a multi-host world reaches its peers
        through where the spec names none (asked of the hosts: `Transport.route_interface`)."""
        targets = worlds.route_targets(spec, sites)
        transport = self.session.transport
        found = fanout(list(targets), lambda k: transport(sites[k].conn).route_interface(
            targets[k]), timeout=AGENT_TIMEOUT, cancel=self.session.abort) if targets else {}
        return {k: dataclasses.replace(s, interface=found[k]) if k in found else s
                for k, s in sites.items()}

    def ports(self, spec: JobSpec, sites: dict[str, plan_model.Site]) -> plan_model.Ports:
        """Rendezvous ports of every DeepSpeed world and the relays' ports (a tunnel's local end
        is a Unix socket file: no port)."""
        def port(c: ClusterSpec, h: HostSpec, preferred: int | None) -> int:
            return self.session.transport(sites[worlds.site_key(c, h)].conn).listen_port(preferred)

        masters = {world: port(c, h, None)
                   for world, (c, h) in worlds.rendezvous_hosts(spec).items()}
        relays = {}
        if spec.relay is not None:
            for c in spec.clusters:
                relays[c.name] = (port(c, c.gateway_host, spec.relay.port),
                                  port(c, c.gateway_host, spec.relay.effective_worker_port))
        labels = {c.name: port(c, c.gateway_host, labels_port(spec)) for c in spec.clusters
                  if spec.distill is not None and c.kind.serves_labels}
        return plan_model.Ports(masters=masters, relays=relays, labels=labels)

    def plan(self, spec: JobSpec, job_id: str, *, renew: bool = False,
             conns: dict[str, Conn] | None = None) -> plan_model.JobPlan:
        """The job's plan: what the hosts report, the job's certificates (issued, or with
        ``renew`` re-issued from the job's CA key when it has one) and a new key per SSH
        tunnel, a new world secret (`AgentConfig.world_secret`), then `build_plan`."""
        sites = self.routes(spec, self.sites(spec, conns))
        ports = self.ports(spec, sites)
        certs = None
        if spec.relay is not None:
            pki_dir = self.store.job_dir(job_id) / "pki"
            valid_for = dt.timedelta(days=spec.lifetime_days)
            issued = pki.renew_job_pki(pki_dir, valid_for=valid_for) \
                if renew and (pki_dir / "ca.key").is_file() else pki.issue_job_pki(
                    job_id, {c.name: [h.host for h in c.hosts] for c in spec.clusters},
                    pki_dir, valid_for=valid_for)
            certs = plan_model.Certs(
                ca=issued.ca_cert.read_bytes(),
                relays={c.name: _pair(issued.relay(c.name)) for c in spec.clusters},
                workers={worlds.site_key(c, h): _pair(issued.worker(c.name, h.host))
                         for c in spec.clusters for h in c.hosts},
                tunnel_keys={link.key: pki.ssh_keypair() for link in tunnel_links(spec)},
                expires=pki.expiry(pki_dir))
        return jobplan.build_plan(spec, job_id, sites=sites, ports=ports, certs=certs,
                                  world_secret=secrets.token_hex(32))


def _pair(pair: pki.CertPair) -> tuple[bytes, bytes]:
    return pair.cert.read_bytes(), pair.key.read_bytes()
