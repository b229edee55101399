"""`nebula bench-network`: latency and throughput between clusters, as the relay would see them.

For every pair of clusters (gateway to gateway, both directions) and, with `intra`, from the
first to the second host of each cluster: round trips of small frames (median and p95) and
`streams` parallel connections sending for `duration` seconds, over the relay's transport (wire
frames on mutual TLS 1.3 with a throwaway per-run PKI, sockets tuned as the relay tunes them)
and over plain TCP for comparison. Both directions go over connections opened the way the
job's relays open theirs (`reach.links`): the cluster that dials runs the measurer, which
sends (one direction) or has the server send (`--reverse`, the other); where the relays meet
through an SSH tunnel, so does the measurer (`netbench_tunnels`: a throwaway key let into the
dialled host for the probe's two ports while the run lasts). Probes (`python -m
nebula_cli.netbench.probe`) run on the hosts through their transports: a server on each dialled
gateway, the measurer on the dialling one; pairs run one after another so that they do not
share a link. Every probe, tunnel and key is ended and every file removed afterwards, also when
something failed.

On each host the run lives in `<nebula home>/netbench/<run id>/<cluster>/<host>/`: the probe's
few modules (lib/nebula_cli), ca.pem, cert.pem and key.pem (0600; the relay pair on a gateway, a
worker pair elsewhere). The CA key never leaves this machine (a temporary directory).

Report (`run_bench` returns it, `write_report` writes it as JSON, `load_report` reads it back;
`nebula plan` reads this)::

    {"version": 1,
     "created": "2025-01-01T12:00:00+00:00",   # ISO 8601, UTC, when the run started
     "run": "netbench-20250101-120000-ab12",    # run id (the job id of the throwaway PKI)
     "job": "<spec name>", "duration_s": 5.0, "streams": 4,
     "pairs": [PAIR, ...],                      # a -> b for every ordered pair of clusters
     "clusters": {"<name>": {"intra": PAIR | null}},   # null: not asked, or one host only
     "errors": ["east/e1: ...", ...]}           # empty when every measurement succeeded

    PAIR = {"a": src cluster, "b": dst cluster, "src_host", "dst_host",   # the data's way
            "src_addr", "dst_addr",             # their addresses (the dialled one: as dialled)
            "dialer": cluster,                  # whose side opened the connections
            "path": "direct" | "ssh tunnel",
            "measured": ISO 8601 time,
            "rtt_ms", "rtt_p95_ms",             # TLS round trip of a 64-byte frame: median, p95
            "throughput_mbit",                  # TLS, all streams, bytes as received, Mbit/s
            "plain_rtt_ms", "plain_rtt_p95_ms", "plain_throughput_mbit",   # the same, plain TCP
            "cipher",                           # the TLS 1.3 cipher suite negotiated
            "error": str}                       # only when this pair failed (figures are null)
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import posixpath
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nebula_cli import pki
from nebula_cli.config import reach, strict
from nebula_cli.config.relay_plan import TUNNEL_GRANT_TTL
from nebula_cli.config.spec import ClusterSpec, JobSpec
from nebula_cli.control.fanout import GroupError, fanout
from nebula_cli.control.netbench_tunnels import (
    TUNNEL_FILES,
    TUNNEL_MODULE,
    WAIT,
    BenchTunnel,
    dial_files,
    grant_config,
    new_tunnel,
    two_free_ports,
    wrap,
)
from nebula_cli.control.planning import HostFacts
from nebula_cli.errors import NebulaError, TransportError, UsageError
from nebula_cli.netbench.probe import MODULE as PROBE_MODULE
from nebula_cli.transport import Conn, Transport

VERSION = 1
PACKAGE_DIR = Path(__file__).resolve().parent.parent
PROBE_FILES = ("__init__.py", "errors.py", "pki/__init__.py", "pki/certs.py", "pki/sshkeys.py",
               "pki/tls.py",
               "relay/__init__.py", "relay/net/__init__.py", "relay/net/wire.py",
               "relay/net/admission.py", "agent/__init__.py", "agent/unix_socket.py",
               "netbench/__init__.py", "netbench/probe.py",
               "netbench/measure.py")  # what the probe imports
PINGS = 200
PROBE_CERT_LIFETIME = dt.timedelta(days=1)
"""The probes' certificates: a measurement lasts minutes."""
SETUP_TIMEOUT = 120.0
START_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0
MEASURE_SLACK = 60.0  # per pair: start-up, connections, round trips, the server's reports
FIGURES = ("rtt_ms", "rtt_p95_ms", "throughput_mbit", "plain_rtt_ms", "plain_rtt_p95_ms",
           "plain_throughput_mbit", "cipher")

Note = Callable[[str], None]
Step = Callable[[str, int, int], None]  # (what runs now, pairs done, pairs in all)


class NetbenchError(NebulaError):
    """The benchmark could not be set up on a host (the message names it)."""


@dataclass(frozen=True)
class Node:
    """One host taking part: where its probe files live and how it is reached."""

    cluster: str
    host: str
    conn: Conn = field(hash=False, compare=False)
    address: str = field(compare=False)  # what the hosts of its cluster reach it at
    dial: str = field(compare=False)  # what other clusters' relays dial (its relay_address)
    root: str = field(compare=False)  # <home>/netbench/<run id> on that host
    relay: bool = field(compare=False)  # the cluster's gateway: probes with the relay's cert
    bind: str = field(compare=False)  # where a service on that host listens

    @property
    def dir(self) -> str:
        return posixpath.join(self.root, self.cluster, self.host)

    def __str__(self) -> str:
        return f"{self.cluster}/{self.host}"


@dataclass(frozen=True)
class Pair:
    """One measurement: `src` (the dialling side, where the measurer runs) dials `dst` (the
    probe server) as its relay would; data flows src -> dst, or dst -> src when `reverse`."""

    src: Node
    dst: Node
    intra: bool
    reverse: bool = False
    tunnel: bool = False
    """Through an SSH tunnel to dst's host (`reach`)."""

    @property
    def target(self) -> str:
        return self.dst.address if self.intra else self.dst.dial

    @property
    def flow(self) -> tuple[Node, Node]:
        """(sender, receiver)."""
        return (self.dst, self.src) if self.reverse else (self.src, self.dst)

    def __str__(self) -> str:
        a, b = self.flow
        how = " through an SSH tunnel" if self.tunnel else ""
        return f"{a} -> {b}" + (f" (dialled by {self.src.cluster}{how})" if self.reverse or
                                self.tunnel else "")


def _quiet(*_: object) -> None:
    pass


def run_id() -> str:
    return f"netbench-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


Planned = tuple[str, str, str, str, bool, bool]
"""(dialling cluster, its host, dialled cluster, its host, reverse, tunnel)."""


def plan_pairs(spec: JobSpec, intra: bool) -> tuple[list[Planned], list[str]]:
    """What to measure, and notes on what is not: both directions of every pair of clusters'
    gateways, over a connection the side that dials (`reach.links`) opens, directly or
    through an SSH tunnel, in the order of the clusters' pairs; with `intra`, the first to
    the second host of each cluster."""
    gates = {c.name: c.gateway_host.host for c in spec.clusters}
    order = list(gates)
    pairs: list[Planned] = sorted(
        [(lk.dialer, gates[lk.dialer], lk.dialled, gates[lk.dialled], reverse, lk.tunnel)
         for lk in reach.links(spec.clusters) for reverse in (False, True)],
        key=lambda p: [order.index(c) for c in ((p[2], p[0]) if p[4] else (p[0], p[2]))])
    notes = []
    if intra:
        for c in spec.clusters:
            if len(c.hosts) < 2:
                notes.append(f"{c.name}: one host, nothing to measure inside it")
            else:
                pairs.append((c.name, c.hosts[0].host, c.name, c.hosts[1].host, False, False))
    if not pairs:
        raise UsageError("nothing to measure: the spec has one cluster"
                         + ("" if intra else " (add --intra to measure inside it)"))
    return pairs, notes


def _nodes(facts: HostFacts, spec: JobSpec, wanted: set[tuple[str, str]],
           run: str) -> dict[tuple[str, str], Node]:
    """Connect to the hosts taking part (only those) and learn their directories and addresses."""
    gateways = {c.name: c.gateway_host.host for c in spec.clusters}
    clusters: list[ClusterSpec] = []
    for c in spec.clusters:
        hosts = [h for h in c.hosts if (c.name, h.host) in wanted]
        if hosts:
            clusters.append(c.model_copy(update={"hosts": hosts, "gateway": None}))
    sites = facts.sites(spec.model_copy(update={"clusters": clusters}))
    nodes = {}
    for c in clusters:
        for h in c.hosts:
            site = sites[f"{c.name}/{h.host}"]
            nodes[(c.name, h.host)] = Node(
                cluster=c.name, host=h.host, conn=site.conn, address=site.address,
                dial=c.relay_address or site.address, bind=site.bind,
                root=posixpath.join(site.home, "netbench", run), relay=h.host == gateways[c.name])
    return nodes


class Bench:
    """One run: set up, measure pair after pair, clean up. See the module docstring."""

    def __init__(self, facts: HostFacts, spec: JobSpec, *, duration: float, streams: int,
                 intra: bool, port: int, note: Note, step: Step) -> None:
        self.facts, self.spec = facts, spec
        self.duration, self.streams, self.intra, self.port = duration, streams, intra, port
        self.note, self.step = note, step
        self.run = run_id()
        self.errors: list[str] = []
        self.servers: dict[Node, dict[str, int]] = {}
        self.tunnels: dict[tuple[Node, Node], BenchTunnel] = {}
        self.server_ports: dict[Node, tuple[int, int]] = {}
        """Fixed (TLS, plain) ports of probe servers that tunnels lead to."""
        self.granted = 0.0  # when the key lines were last written (monotonic)

    def transport(self, node: Node) -> Transport:
        return self.facts.session.transport(node.conn)

    def probe(self, node: Node, *args: str, timeout: float,
              tunnel: BenchTunnel | None = None) -> dict[str, Any]:
        """Run the probe on `node` (inside `tunnel`'s keeper when given); its JSON line, or
        TransportError naming the host."""
        t = self.transport(node)
        argv = [node.conn.python, "-m", PROBE_MODULE, args[0], "--run", self.run, *args[1:]]
        if tunnel is not None:
            argv = wrap(node.conn.python, node.dir, tunnel, argv)
        result = t.run(argv, env={"PYTHONPATH": posixpath.join(node.dir, "lib")}, cwd=node.dir,
                       timeout=timeout)
        for line in reversed(result.stdout.strip().splitlines() if result.ok else []):
            with contextlib.suppress(ValueError):
                reply = json.loads(line)
                if isinstance(reply, dict):
                    return reply
        raise TransportError(f"probe {args[0]} failed: {result}", host=str(node))

    # -- steps ------------------------------------------------------------------------------
    def install(self, node: Node, issued: pki.JobPKI) -> None:
        t = self.transport(node)
        pair = issued.relay(node.cluster) if node.relay else issued.worker(node.cluster,
                                                                             node.host)
        lib = posixpath.join(node.dir, "lib", "nebula_cli")
        for rel in dict.fromkeys((*PROBE_FILES, *TUNNEL_FILES)):
            t.put_bytes((PACKAGE_DIR / rel).read_bytes(), posixpath.join(lib, rel))
        t.put_bytes(issued.ca_cert.read_bytes(), posixpath.join(node.dir, "ca.pem"))
        t.put_bytes(pair.cert.read_bytes(), posixpath.join(node.dir, "cert.pem"))
        t.put_bytes(pair.key.read_bytes(), posixpath.join(node.dir, "key.pem"), mode=0o600)

    def tunnel_up(self, pairs: list[Pair]) -> None:
        """Keys, ports and files of every tunnel a pair measures through; the dialled hosts'
        grants added (see `netbench_tunnels`)."""
        for p in pairs:
            if p.tunnel and (p.src, p.dst) not in self.tunnels:
                if p.dst not in self.server_ports:
                    t = self.transport(p.dst)
                    self.server_ports[p.dst] = (self.port, self.port + 1) if self.port else \
                        two_free_ports(t)
                self.tunnels[(p.src, p.dst)] = new_tunnel(
                    p.src.cluster, p.dst.cluster, server=self.transport(p.dst),
                    address=p.dst.dial, ports=self.server_ports[p.dst])
        for (src, _), tunnel in self.tunnels.items():
            for name, data in dial_files(self.run, tunnel, src.dir).items():
                self.transport(src).put_bytes(data, posixpath.join(src.dir, name), mode=0o600)
        self.grant()
        for dst in self.server_ports:
            self.note(f"{dst}: the run's tunnel keys let in for ports "
                      f"{', '.join(map(str, self.server_ports[dst]))}")

    def grant(self) -> None:
        """(Re)write the dialled hosts' key lines, valid for `grant_s`: `renew` pushes them on
        between pairs, so a run that is killed leaves keys that stop working soon after."""
        by_name = {c.name: c for c in self.spec.clusters}
        expires = datetime.now(UTC) + dt.timedelta(seconds=self.grant_s)
        for dst in self.server_ports:
            cfg = grant_config(self.run, dst.cluster, by_name[dst.cluster].authorized_keys,
                               [t for (_, d), t in self.tunnels.items() if d == dst], expires)
            self.transport(dst).put_bytes(strict.dumps(cfg),
                                          posixpath.join(dst.dir, "tunnels.json"), mode=0o600)
            self.transport(dst).run_checked(
                [dst.conn.python, "-m", TUNNEL_MODULE, "grant", dst.dir], timeout=STOP_TIMEOUT,
                env={"PYTHONPATH": posixpath.join(dst.dir, "lib")})
        self.granted = time.monotonic()

    @property
    def grant_s(self) -> float:
        """How long a key line of the run is valid: the job's tunnels' `TUNNEL_GRANT_TTL`, and
        one pair's longest measurement, which a line written just before it must outlast."""
        return TUNNEL_GRANT_TTL + 2 * self.duration + MEASURE_SLACK + WAIT

    def renew(self) -> None:
        """Push the key lines on once a third of `TUNNEL_GRANT_TTL` has passed since."""
        if self.server_ports and time.monotonic() - self.granted >= TUNNEL_GRANT_TTL / 3:
            self.grant()

    def serve(self, node: Node, lifetime: float) -> dict[str, int]:
        # the transport knows whether hosts share this machine's ports (then: a free one)
        port, plain = self.server_ports.get(node) or (
            self.facts.session.transport(node.conn).listen_port(self.port), 0)
        reply = self.probe(node, "serve", "--certs", node.dir, "--bind", node.bind,
                           "--port", str(port), "--plain-port", str(plain),
                           "--lifetime", f"{lifetime:.0f}",
                           "--log", posixpath.join(node.dir, "serve.log"), timeout=START_TIMEOUT)
        self.note(f"{node}: probe server pid {reply['pid']}, TLS port {reply['tls_port']} "
                  "(plain TCP opens per measurement, with one-time tickets)")
        return reply

    def measure(self, pair: Pair) -> dict[str, Any]:
        server = self.servers[pair.dst]
        budget = 2 * self.duration + MEASURE_SLACK + (WAIT if pair.tunnel else 0)
        (a, b), addr = pair.flow, {pair.src: pair.src.address, pair.dst: pair.target}
        row: dict[str, Any] = {
            "a": a.cluster, "b": b.cluster, "src_host": a.host, "dst_host": b.host,
            "src_addr": addr[a], "dst_addr": addr[b], "dialer": pair.src.cluster,
            "path": "ssh tunnel" if pair.tunnel else "direct",
            "measured": _now(), **dict.fromkeys(FIGURES),
        }
        tunnel = self.tunnels.get((pair.src, pair.dst)) if pair.tunnel else None
        try:  # through a tunnel, `wrap` names its local ends, dialled instead of the ports
            figures = self.probe(
                pair.src, "measure", "--certs", pair.src.dir, "--host", pair.target,
                "--tls-port", str(server["tls_port"]), *(["--reverse"] if pair.reverse else []),
                "--peer-cluster", pair.dst.cluster, "--duration", str(self.duration),
                "--streams", str(self.streams), "--pings", str(PINGS),
                "--deadline", f"{budget:.0f}", timeout=budget + 15, tunnel=tunnel)
            row.update({k: figures.get(k) for k in FIGURES})
        except NebulaError as exc:
            row["error"] = f"{pair}: {exc}"
            self.errors.append(row["error"])
        return row

    def cleanup(self, nodes: list[Node], installed: bool) -> None:
        """Stop every probe of the run, then remove its directories; problems go to errors.
        Stops first on every host: hosts may share a file system (and so the probe's lib)."""
        if installed:
            try:
                fanout(nodes, lambda n: self.probe(n, "stop", timeout=STOP_TIMEOUT),
                       timeout=STOP_TIMEOUT + 10, cancel=self.facts.session.abort)
            except GroupError as exc:
                self.errors += [f"{n}: probes may be left running: {e}"
                                for n, e in exc.failures.items()]
        for node in self.server_ports:  # the run's keys out, before its files go
            try:
                self.transport(node).run_checked(
                    [node.conn.python, "-m", TUNNEL_MODULE, "revoke", node.dir],
                    env={"PYTHONPATH": posixpath.join(node.dir, "lib")}, timeout=STOP_TIMEOUT)
            except NebulaError as exc:
                self.errors.append(f"{node}: the run's tunnel keys may be left: {exc}")

        def remove(node: Node) -> None:
            if f"/netbench/{self.run}" not in node.root:  # never anything but this run's dir
                raise NetbenchError(f"refusing to remove {node.root}")
            self.transport(node).run_checked(
                ["/bin/sh", "-c", 'rm -rf -- "$1"; rmdir -- "$(dirname "$1")" 2>/dev/null; true',
                 "sh", node.root], timeout=STOP_TIMEOUT)

        try:
            fanout(nodes, remove, timeout=STOP_TIMEOUT + 10, cancel=self.facts.session.abort)
        except GroupError as exc:
            self.errors += [f"{n}: {n.root} not removed: {e}"  # type: ignore[attr-defined]
                            for n, e in exc.failures.items()]

    # -- the run ----------------------------------------------------------------------------
    def __call__(self) -> dict[str, Any]:
        plan, notes = plan_pairs(self.spec, self.intra)
        for text in notes:
            self.note(text)
        created = _now()
        self.step("connecting", 0, len(plan))
        nodes = _nodes(self.facts, self.spec, {(a, h) for a, h, *_ in plan}
                       | {(b, h) for _, _, b, h, *_ in plan}, self.run)
        pairs = [Pair(nodes[(a, ha)], nodes[(b, hb)], a == b, reverse, tunnel)
                 for a, ha, b, hb, reverse, tunnel in plan]
        rows: list[dict[str, Any]] = []
        installed = False
        try:
            self.step("uploading the probe", 0, len(pairs))
            with tempfile.TemporaryDirectory(prefix="nebula-netbench-") as tmp:
                issued = pki.issue_job_pki(
                    self.run, {c: [h for (cc, h) in nodes if cc == c]
                               for c in dict.fromkeys(c for c, _ in nodes)}, Path(tmp),
                    valid_for=PROBE_CERT_LIFETIME)
                fanout(list(nodes.values()), lambda n: self.install(n, issued),
                       timeout=SETUP_TIMEOUT, cancel=self.facts.session.abort)
            installed = True
            self.tunnel_up(pairs)
            lifetime = len(pairs) * (2 * self.duration + MEASURE_SLACK) + 2 * SETUP_TIMEOUT
            dsts = list(dict.fromkeys(p.dst for p in pairs))
            self.step("starting probe servers", 0, len(pairs))
            self.servers = fanout(dsts, lambda n: self.serve(n, lifetime),
                                  timeout=START_TIMEOUT + 10, cancel=self.facts.session.abort)
            for i, pair in enumerate(pairs):
                self.renew()
                a, b = pair.flow
                self.step(f"{a.cluster} -> {b.cluster} ({a.host} -> {b.host})", i, len(pairs))
                rows.append(self.measure(pair))
            self.step("done", len(pairs), len(pairs))
        finally:
            self.step("removing the probes", len(rows), len(pairs))
            self.cleanup(list(nodes.values()), installed)
        intra = {r["a"]: r for r, p in zip(rows, pairs, strict=True) if p.intra}
        return {
            "version": VERSION, "created": created, "run": self.run, "job": self.spec.name,
            "duration_s": self.duration, "streams": self.streams,
            "pairs": [r for r, p in zip(rows, pairs, strict=True) if not p.intra],
            "clusters": {c.name: {"intra": intra.get(c.name)} for c in self.spec.clusters},
            "errors": self.errors,
        }


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def run_bench(facts: HostFacts, spec: JobSpec, *, duration: float = 5.0, streams: int = 4,
              intra: bool = False, port: int = 0, note: Note = _quiet,
              step: Step = _quiet) -> dict[str, Any]:
    """Measure the network of `spec`'s clusters; the report (see the module docstring).

    Raises UsageError for bad options, NetbenchError / TransportError (naming the host) when
    the run cannot be set up; a pair that fails is reported in the pair and in "errors"."""
    if not 0.2 <= duration <= 600:
        raise UsageError(f"--duration must be between 0.2 and 600 seconds, got {duration:g}")
    if not 1 <= streams <= 64:
        raise UsageError(f"--streams must be between 1 and 64, got {streams}")
    if port and not 1024 <= port <= 65534:
        raise UsageError(f"--port must be between 1024 and 65534 (it uses port and port+1), "
                         f"got {port}")
    bench = Bench(facts, spec, duration=duration, streams=streams, intra=intra, port=port,
                  note=note, step=step)
    try:
        return bench()
    except UsageError:
        raise
    except NebulaError as exc:  # what cleaning up found goes with it
        failures = exc.failures.items() if isinstance(exc, GroupError) else [(None, exc)]
        lines = [str(e) if k is None or str(e).startswith(f"{k}:") else f"{k}: {e}"
                 for k, e in failures]
        raise NetbenchError("\n".join(lines + bench.errors)) from exc


def write_report(report: dict[str, Any], path: Path) -> None:
    """Write the report as JSON (atomically: a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc


def load_report(path: Path) -> dict[str, Any]:
    """A report written by `write_report`, checked for its version and main keys."""
    try:
        report = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise UsageError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(report, dict) or report.get("version") != VERSION:
        raise UsageError(f"{path} is not a bench-network report of version {VERSION}")
    if not isinstance(report.get("pairs"), list) or not isinstance(report.get("clusters"), dict):
        raise UsageError(f"{path} lacks 'pairs' or 'clusters'")
    return report
