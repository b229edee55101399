"""`nebula validate --hosts`: which way each pair of clusters' relays can connect, tried from
the relays' own hosts, and whether the plan's way (`reach.links`) is one of them.

On every relay host a listener holds the port its relay will use, where the relay will listen,
for a few seconds; meanwhile every relay host tries, towards every other cluster:

- ``direct``: a TCP connection to that relay port, at the address relays dial (its
  `relay_address`, else its host's);
- ``tunnel``: a TCP connection to that cluster's SSH host (as the tunnel would: `relay_address`,
  else the address and port nebula uses) and its banner ("SSH-2.0-..."); and whether ``ssh`` is
  on this host's PATH.

A path works when it connected (direct) or an sshd answered (ssh); a connection refused, or not
answered within PROBE_WAIT, does not. Not tried: whether that sshd allows TCP forwarding (a
tunnel's log says so at once). A Slurm cluster's relay runs on a node known only once its
allocation runs (unless `relay_on: login`): its direct paths are not tried.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from nebula_cli.config import worlds
from nebula_cli.config.reach import Link, links, problems
from nebula_cli.config.spec import ClusterSpec, JobSpec
from nebula_cli.control.fanout import GroupError, fanout
from nebula_cli.control.planning import HostFacts
from nebula_cli.errors import NebulaError

PROBE_WAIT = 5.0
"""Seconds a connection attempt waits for an answer (refusals are retried meanwhile: the
listener may start a moment later)."""
LISTEN_HEAD = 1.0
"""Seconds the connection attempts start after the listeners."""
DIRECT, TUNNEL = "direct", "tunnel"
"""The ways tried: a TCP connection to the relay port; an sshd answering (for a tunnel)."""
MAX_SUGGEST = 6
"""Most clusters for which a `relay_reach` that would work is looked for (3^n specs)."""

PROBE = r"""
import json, shutil, socket, sys, time
mode, host, port, wait = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if mode == "listen":
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(64)
    except OSError as exc:
        print(json.dumps({"bound": False, "said": exc.strerror or str(exc)}))
        sys.exit(0)
    s.settimeout(0.2)
    end = time.time() + wait
    while time.time() < end:
        try:
            s.accept()[0].close()
        except OSError:
            pass
    print(json.dumps({"bound": True}))
    sys.exit(0)
time.sleep(float(sys.argv[5]))
out = {"ssh_client": shutil.which("ssh") is not None}
end = time.time() + wait
while True:
    try:
        c = socket.create_connection((host, port), timeout=max(end - time.time(), 0.1))
    except ConnectionRefusedError:
        if time.time() < end - 0.3:
            time.sleep(0.3)
            continue
        out.update(works=False, said="refused")
        break
    except socket.timeout:
        out.update(works=False, said="no answer in %g s" % wait)
        break
    except OSError as exc:
        out.update(works=False, said=exc.strerror or str(exc))
        break
    if mode == "tunnel":
        c.settimeout(max(end - time.time(), 2.0))
        try:
            banner = c.recv(256).split(b"\n")[0].decode(errors="replace").strip()
        except OSError:
            banner = ""
        ok = banner.startswith("SSH-")
        out.update(works=ok, said="sshd " + banner.split("-", 2)[-1].split()[0][:40] if ok
                   else "no SSH banner")
    else:
        out.update(works=True, said="connected")
    c.close()
    break
print(json.dumps(out))
"""


@dataclass
class Way:
    """One way a relay could reach another, as tried: did it work, and what was seen."""

    works: bool | None
    """None: not tried (see `said`)."""
    said: str


@dataclass
class PairCheck:
    """One pair of clusters: each way tried, and the plan's link."""

    a: str
    b: str
    link: Link
    ways: dict[tuple[str, str, str], Way] = field(default_factory=dict)
    """(from, to, DIRECT | TUNNEL) -> what was seen."""

    def way(self, src: str, dst: str, kind: str) -> Way:
        return self.ways.get((src, dst, kind), Way(None, "not tried"))

    @property
    def planned(self) -> Way:
        """The way the plan uses."""
        return self.way(self.link.dialer, self.link.dialled,
                        TUNNEL if self.link.tunnel else DIRECT)

    def __str__(self) -> str:
        return f"{self.a} - {self.b}"


@dataclass
class ReachReport:
    pairs: list[PairCheck]
    notes: list[str]
    suggestion: dict[str, str] | None = None
    """cluster -> relay_reach that would connect every pair (only when the plan's does not)."""

    @property
    def problems(self) -> list[str]:
        out = []
        for p in self.pairs:
            way = p.planned
            if way.works is False:
                how = (f"through an SSH tunnel to {p.link.dialled}'s SSH host" if p.link.tunnel
                       else f"to {p.link.dialled}'s relay port")
                out.append(f"{p.link.dialer} cannot reach {p.link.dialled} {how}: {way.said}")
        return out


def check_reach(facts: HostFacts, spec: JobSpec) -> ReachReport:
    """Try every way between every pair of clusters (see the module docstring)."""
    by_name = {c.name: c for c in spec.clusters}
    sites = facts.sites(spec)
    gw = {c.name: sites[worlds.site_key(c, c.gateway_host)] for c in spec.clusters}
    notes = [f"{c.name}: its relay's node is known once the allocation runs: direct ways not "
             "tried" for c in spec.clusters if not c.relay_host_known]
    assert spec.relay is not None
    ports = {c.name: facts.session.transport(gw[c.name].conn).listen_port(spec.relay.port)
             for c in spec.clusters if c.relay_host_known}
    sshd: dict[str, tuple[str, int]] = {}
    for c in spec.clusters:
        login = facts.session.transport(sites[worlds.site_key(c, c.ssh_host)].conn).ssh_login()
        if login is not None:
            sshd[c.name] = (c.relay_address or sites[worlds.site_key(c, c.ssh_host)].address,
                            login[1])
    tries: list[tuple[str, ...]] = [("listen", name) for name in ports]
    for a, b in itertools.permutations(by_name, 2):
        if a in ports and b in ports:
            tries.append((DIRECT, a, b))
        if b in sshd and a in ports:
            tries.append((TUNNEL, a, b))
    life = LISTEN_HEAD + PROBE_WAIT + 2.0

    def run(key: tuple[str, ...]) -> dict[str, Any]:
        if key[0] == "listen":
            site = gw[key[1]]
            args = ["listen", site.bind, str(ports[key[1]]), f"{life:g}"]
        else:
            kind, src, dst = key
            site = gw[src]
            host, port = (by_name[dst].relay_address or gw[dst].address, ports[dst]) \
                if kind == DIRECT else sshd[dst]
            args = [kind, host, str(port), f"{PROBE_WAIT:g}", f"{LISTEN_HEAD:g}"]
        result = facts.session.transport(site.conn).run([site.python, "-c", PROBE, *args],
                                                timeout=life + 30)
        try:
            return json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise NebulaError(f"the reach probe failed: {result}") from exc

    try:
        found = fanout(tries, run, timeout=life + 60, cancel=facts.session.abort)
    except GroupError as exc:
        found = {k: v for k, v in exc.results.items() if isinstance(v, dict)}
        notes += [f"{' '.join(k)}: {v}" for k, v in exc.failures.items()]  # type: ignore[arg-type]
    for key, said in found.items():
        if key[0] == "listen" and not said.get("bound"):
            notes.append(f"{key[1]}: port {ports[key[1]]} of its relay host is taken "
                         f"({said.get('said')}): a relay could not listen there")
    pairs = []
    for link in links(spec.clusters):
        a, b = sorted((link.dialer, link.dialled), key=list(by_name).index)
        pair = PairCheck(a=a, b=b, link=link)
        for key, said in found.items():
            if key[0] != "listen" and {key[1], key[2]} == {a, b}:
                note = "" if said.get("ssh_client") or key[0] != TUNNEL else \
                    f" (but no ssh client on {key[1]}'s relay host)"
                pair.ways[(key[1], key[2], key[0])] = Way(
                    bool(said.get("works")) and not note, f"{said.get('said')}{note}")
        pairs.append(pair)
    report = ReachReport(pairs=pairs, notes=notes)
    if report.problems:
        report.suggestion = suggest(spec, report)
    return report


def suggest(spec: JobSpec, report: ReachReport) -> dict[str, str] | None:
    """The fewest changes of `relay_reach` whose links all use ways that worked (None: none,
    or too many clusters to look)."""
    if len(spec.clusters) > MAX_SUGGEST:
        return None
    works = {k for p in report.pairs for k, w in p.ways.items() if w.works}
    best: tuple[int, dict[str, str]] | None = None
    for reaches in itertools.product(("inbound", "outbound", "ssh"), repeat=len(spec.clusters)):
        try:  # each cluster as the spec would have it (some reach needs an sshd)
            clusters = [ClusterSpec.model_validate({**c.model_dump(), "relay_reach": r})
                        for c, r in zip(spec.clusters, reaches, strict=True)]
        except ValidationError:
            continue
        if problems(clusters):
            continue
        if all((lk.dialer, lk.dialled, TUNNEL if lk.tunnel else DIRECT) in works
               for lk in links(clusters)):
            changes = {c.name: r for c, r in zip(spec.clusters, reaches, strict=True)
                       if r != c.relay_reach}
            if changes and (best is None or len(changes) < best[0]):
                best = (len(changes), changes)
    return best[1] if best else None

