"""The test bed: SSH clusters on one machine, made of network namespaces.

Topology of one bed (`<id>` is `nb` + 4 random hex digits, e.g. `nb3f0a`; needs root):

    root namespace (pytest, nebula)            router namespace `<id>-r` (ip_forward on)
      veth `<id>`  mgmt .1  ------------------  `up0`  mgmt .2
                                                bridge `b<i>` per cluster i, holding:
                                                  `s<i>`  <-veth->  `r<i>`  cluster net .254
                                                  `h<k>`  <-veth->  `eth0` of host k
                                                `rb` bastion net .254  <-veth-> `eth0` of bastion

    host namespace `<id>-<host>`: lo, `eth0` = <cluster net>.<n> (n = 1, 2, ... in list order),
      route <slot net> via <cluster net>.254, its own sshd on <address>:22.
    bastion namespace `<id>-bastion` (when bastion=True): `eth0` = bastion net .1.

Addresses (all inside 198.18.0.0/15, a /18 slot per live bed): system.py.

Reachability: the hosts of a cluster share a bridge (one L2 hop, ping TTL 64); traffic between
clusters is routed by the router (ping TTL 63). ProxyJump: sshd.py.

Shaping and latency: see links.py. SSH: sshd.py. Processes, namespaces, addresses: system.py;
the beds recorded on this machine and their removal: registry.py.

Files: keys, sshd configs, logs, known_hosts and ssh_config live in `<workdir>/<id>/` (default
workdir /tmp/nebula-testbed; it must outlive the bed, as sshd re-reads its config and host key on
every connection: not pytest's tmp_path, which concurrent sessions prune). `down()` ends every
process in the bed's namespaces (sshd, proxies, whatever tests started there), deletes the
namespaces (and so every veth and bridge) and the root veth, and removes both directories.

Slurm (optional): `slurm={"hpc": "login"}` (with `slurm_cgroup=True`: proctrack/cgroup), see
slurm.py; its compute nodes are in `compute`, not
`hosts` (`run`/`popen`/`cut` accept them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from . import slurm as slurm_mod
from .links import Links
from .registry import STATE_ROOT, _state_lock, cleanup_stale, destroy, read_states
from .slurm import SlurmCluster, SlurmError
from .sshd import SSHD, SshHosts
from .system import (
    HOST_IFACE,
    SLOTS,
    TestBedError,
    _addr,
    _cmdline,
    _sh,
    _start_time,
    _stop_popen,
    kill_pids,
    list_namespaces,
    namespace_pids,
    slot_net,
    subnet,
)

MAX_CLUSTERS = 32
BASTION_INDEX, MGMT_INDEX = 32, 33
HOST_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
RESERVED_NAMES = {"r", "bastion", "router"}
DEFAULT_CLUSTERS = {"east": ["e1", "e2"], "west": ["w1", "w2"]}
LINK_MODES = ("pair", "cluster")


@dataclass(frozen=True)
class Host:
    """One host of the bed: a network namespace with its own sshd on `address:ssh_port`
    (a Slurm compute node has none: sshd False)."""

    name: str
    cluster: str
    ns: str
    address: str
    ssh_port: int = 22
    sshd: bool = True


class TestBed(Links, SshHosts):
    """Clusters of SSH hosts in network namespaces, joined by a shaped router. See module doc."""

    __test__ = False  # not a pytest test class

    def __init__(self, clusters: dict[str, list[str]] | None = None, *,
                 rate_mbit: float | None = 100, bastion: bool = True,
                 workdir: Path | None = None, slurm: dict[str, str] | None = None,
                 slurm_cgroup: bool = False, link: str = "pair",
                 tcp: str | None = None) -> None:
        clusters = {c: list(hs) for c, hs in (clusters or DEFAULT_CLUSTERS).items()}
        names = [h for hs in clusters.values() for h in hs]
        bad = [n for n in [*clusters, *names] if not HOST_NAME.match(n) or n in RESERVED_NAMES]
        if bad or len(set(names)) != len(names) or not names:
            raise TestBedError(f"cluster and host names must be unique, lowercase [a-z0-9-], "
                               f"not {sorted(RESERVED_NAMES)}; got {clusters}")
        if len(clusters) > MAX_CLUSTERS or any(not 0 < len(hs) < 254 for hs in clusters.values()):
            raise TestBedError("at most 32 clusters of 1..253 hosts")
        if rate_mbit is not None and rate_mbit <= 0:
            raise TestBedError(f"rate_mbit must be positive or None, got {rate_mbit}")
        if link not in LINK_MODES:
            raise TestBedError(f"link must be one of {LINK_MODES}, got {link!r}")
        allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
        if tcp is not None and tcp not in (allowed.read_text().split() if allowed.exists()
                                           else []):
            raise TestBedError(f"tcp {tcp!r} is not allowed here (tcp_allowed_congestion_control:"
                               f" {allowed.read_text().strip() if allowed.exists() else '?'})")
        slurm = dict(slurm or {})
        if len(slurm) > 1 or any(c not in clusters or login not in clusters[c]
                                 or len(clusters[c]) < 2 for c, login in slurm.items()):
            raise TestBedError(f"slurm wants {{cluster: its login host}} for one cluster of two "
                               f"hosts or more; got {slurm}")
        self.clusters = clusters
        self.rate_mbit = rate_mbit
        self.link = link
        self.tcp = tcp
        """The hosts' TCP congestion control (None: this machine's default), see module doc."""
        """"pair": a link per pair of clusters; "cluster": one link per cluster (module doc)."""
        self.id = "nb" + secrets.token_hex(2)
        self.dir = Path(workdir or STATE_ROOT) / self.id
        self.router_ns = f"{self.id}-r"
        self.slot: int | None = None
        self.hosts: dict[str, Host] = {}
        self.bastion: Host | None = None
        self._want_bastion = bastion
        self._rates: dict[frozenset[str], float | None] = {}  # link "pair"
        self._cluster_rates: dict[str, float | None] = {}  # link "cluster"
        self._host_index: dict[str, int] = {}
        self._cut: set[str] = set()
        self._stopped: set[str] = set()
        self._procs: list[subprocess.Popen] = []
        self._proxies: dict[tuple[str, int], subprocess.Popen] = {}
        self._up = False
        self._slurm_spec = slurm
        self._slurm_cgroup = slurm_cgroup
        self.compute: dict[str, Host] = {}  # Slurm compute nodes: no sshd
        self.slurm: SlurmCluster | None = None

    # ------------------------------------------------------------- availability, lifecycle

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether a bed can be built here: (True, "") or (False, the reason)."""
        if os.geteuid() != 0:
            return False, "the test bed needs root (network namespaces, sshd)"
        for tool in ("ip", "tc", "ssh", "ssh-keygen"):
            if shutil.which(tool) is None:
                return False, f"{tool} not found (apt-get install iproute2 openssh-client)"
        if not os.access(SSHD, os.X_OK):
            return False, f"{SSHD} not found (apt-get install openssh-server)"
        probe = _sh(["ip", "netns", "list"], check=False)
        if probe.returncode != 0:
            return False, f"ip netns does not work: {probe.stderr.strip()}"
        return True, ""

    @staticmethod
    def slurm_available() -> tuple[bool, str]:
        """Whether a bed with Slurm can be built here: (True, "") or (False, the reason)."""
        ok, reason = TestBed.available()
        return slurm_mod.available() if ok else (ok, reason)

    @property
    def user_key(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    def __enter__(self) -> TestBed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> TestBed:
        """Build the bed (about a second); on any failure tear down what was built, re-raise."""
        if self._up:
            return self
        ok, reason = self.available()
        if not ok:
            raise TestBedError(reason)
        self._up = True
        try:
            self._reserve_slot()
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove every namespace, veth, bridge, sshd, proxy and file of the bed (idempotent)."""
        for proc in [*self._procs, *self._proxies.values()]:
            _stop_popen(proc)
        self._procs.clear()
        self._proxies.clear()
        if self.slurm is not None:
            self.slurm.stop()
            self.slurm = None
        if self._up:
            destroy(self.id, dirs=[self.dir])
            self._up = False

    def _reserve_slot(self) -> None:
        cleanup_stale()
        with _state_lock():
            used = {s.get("slot") for s in read_states().values()}
            free = [s for s in range(SLOTS) if s not in used]
            if not free:
                raise TestBedError(f"all {SLOTS} test bed slots are in use: {sorted(used)}")
            self.slot = free[0]
            self.dir.mkdir(parents=True, exist_ok=True)
            self._write_state()

    def _write_state(self, manual: bool = False) -> None:
        state_dir = STATE_ROOT / self.id
        state_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "id": self.id, "pid": os.getpid(), "pid_start": _start_time(os.getpid()),
            "slot": self.slot, "dir": str(self.dir), "manual": manual,
            "ssh_config": str(self.ssh_config),
            "hosts": {h.name: [h.cluster, h.address] for h in self._all_hosts()},
            "compute": {h.name: [h.cluster, h.address] for h in self.compute.values()},
            **({"slurm": self.slurm.state()} if self.slurm else {}),
        }
        tmp = state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(state_dir / "state.json")

    def keep_after_exit(self) -> None:
        """Mark the bed manual: cleanup_stale() leaves it alone after this process exits."""
        self._write_state(manual=True)

    # --------------------------------------------------------------------------- building

    def _build(self) -> None:
        assert self.slot is not None
        for state in (self.hosts, self.compute, self._rates, self._cluster_rates,
                      self._host_index, self._cut, self._stopped):
            state.clear()
        self.bastion = None
        compute = {h for c, login in self._slurm_spec.items() for h in self.clusters[c]
                   if h != login}
        self.dir.chmod(0o700)
        mgmt = subnet(self.slot, MGMT_INDEX)
        supernet = str(slot_net(self.slot))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.id}-user",
             "-f", str(self.user_key)])

        # Router, and the root namespace's link to it.
        self._add_ns(self.router_ns, forward=True)
        _sh(["ip", "link", "add", self.id, "type", "veth", "peer", "name", "up0",
             "netns", self.router_ns])
        _sh(["ip", "addr", "add", f"{_addr(mgmt, 1)}/24", "dev", self.id])
        _sh(["ip", "link", "set", self.id, "up"])
        self._ip_r("addr", "add", f"{_addr(mgmt, 2)}/24", "dev", "up0")
        self._ip_r("link", "set", "up0", "up")
        _sh(["ip", "route", "add", supernet, "via", _addr(mgmt, 2), "dev", self.id])

        k = 0
        for i, (cluster, names) in enumerate(self.clusters.items()):
            net = subnet(self.slot, i)
            self._ip_r("link", "add", f"b{i}", "type", "bridge")
            self._ip_r("link", "set", f"b{i}", "up")
            self._ip_r("link", "add", f"r{i}", "type", "veth", "peer", "name", f"s{i}")
            self._ip_r("link", "set", f"s{i}", "master", f"b{i}", "up")
            self._ip_r("addr", "add", f"{_addr(net, 254)}/24", "dev", f"r{i}")
            self._ip_r("link", "set", f"r{i}", "up")
            for n, name in enumerate(names, start=1):
                host = Host(name, cluster, f"{self.id}-{name}", _addr(net, n),
                            sshd=name not in compute)
                self._host_index[name] = k
                self._add_host(host, router_if=f"h{k}", bridge=f"b{i}", gateway=_addr(net, 254))
                (self.hosts if host.sshd else self.compute)[name] = host
                k += 1
        if self._want_bastion:
            net = subnet(self.slot, BASTION_INDEX)
            host = Host("bastion", "", f"{self.id}-bastion", _addr(net, 1))
            self._add_host(host, router_if="rb", bridge=None, gateway=_addr(net, 254))
            self._ip_r("addr", "add", f"{_addr(net, 254)}/24", "dev", "rb")
            self.bastion = host

        if self.link == "pair":
            for a, b in combinations(self.clusters, 2):
                self._rates[frozenset((a, b))] = self.rate_mbit
        else:
            self._cluster_rates.update(dict.fromkeys(self.clusters, self.rate_mbit))
        for cluster in self.clusters:
            self._shape(cluster)
        self._write_ssh_files()
        self._write_state()
        for cluster, login in self._slurm_spec.items():
            self.slurm = SlurmCluster(self.id, self.dir / "slurm", cluster, self.hosts[login],
                                      [self.compute[h] for h in self.clusters[cluster]
                                       if h != login], cgroup=self._slurm_cgroup)
        for host in self._all_hosts():
            self._write_sshd_config(host)
            self.start_sshd(host.name)
        if self.slurm is not None:
            try:
                self.slurm.start()
            except SlurmError as exc:
                raise TestBedError(f"Slurm of bed {self.id}: {exc}") from None
            self._write_state()

    def _add_ns(self, ns: str, *, forward: bool = False) -> None:
        _sh(["ip", "netns", "add", ns])
        _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        # /proc/sys/net shows the writer's namespace; no sysctl(8) needed (procps may be absent).
        sysctls: dict[str, str | int] = {"ipv6/conf/all/disable_ipv6": 1,
                                         "ipv6/conf/default/disable_ipv6": 1,
                                         "ipv4/ip_forward": int(forward)}
        if self.tcp is not None and not forward:
            sysctls["ipv4/tcp_congestion_control"] = self.tcp
        script = "; ".join(f"echo {v} > /proc/sys/net/{k}" for k, v in sysctls.items())
        _sh(["ip", "netns", "exec", ns, "sh", "-ec", script])

    def _add_host(self, host: Host, *, router_if: str, bridge: str | None, gateway: str) -> None:
        self._add_ns(host.ns)
        self._ip_r("link", "add", router_if, "type", "veth", "peer", "name", HOST_IFACE,
                   "netns", host.ns)
        if bridge:
            self._ip_r("link", "set", router_if, "master", bridge)
        self._ip_r("link", "set", router_if, "up")
        _sh(["ip", "-n", host.ns, "addr", "add", f"{host.address}/24", "dev", HOST_IFACE])
        self._link_up(host, gateway)

    def _link_up(self, host: Host, gateway: str) -> None:
        _sh(["ip", "-n", host.ns, "link", "set", HOST_IFACE, "up"])
        _sh(["ip", "-n", host.ns, "route", "replace", str(slot_net(self.slot or 0)),
             "via", gateway])

    def _ip_r(self, *args: str) -> None:
        _sh(["ip", "-n", self.router_ns, *args])

    def _all_hosts(self) -> list[Host]:
        return [*self.hosts.values(), *([self.bastion] if self.bastion else [])]

    # ------------------------------------------------------------------------- access

    def interface(self, host: str) -> str:
        """The interface inside the host's namespace that reaches its peers (GLOO_SOCKET_IFNAME)."""
        self._host(host)
        return HOST_IFACE

    def hosts_of(self, cluster: str) -> list[Host]:
        """Every host of the cluster, Slurm compute nodes included (they have sshd False)."""
        return [self._host(name) for name in self.clusters[cluster]]

    def exec_prefix(self, host: str) -> list[str]:
        """argv prefix that runs a command inside the host's (or "router"'s) namespace."""
        ns = self.router_ns if host == "router" else self._host(host).ns
        return ["ip", "netns", "exec", ns]

    def run(self, host: str, cmd: str | Sequence[str], *, timeout: float = 60,
            check: bool = False, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run cmd (argv, or a string for `sh -c`) in the host's namespace; output captured."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        proc = subprocess.run([*self.exec_prefix(host), *argv], capture_output=True, text=True,
                              timeout=timeout, input=input,
                              stdin=None if input is not None else subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise TestBedError(f"{host}: {shlex.join(argv)} exited {proc.returncode}: "
                               f"{proc.stdout}{proc.stderr}")
        return proc

    def popen(self, host: str, cmd: str | Sequence[str], **kwargs) -> subprocess.Popen:
        """Start cmd in the host's namespace in the background; ended by down() at the latest."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen([*self.exec_prefix(host), *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def wait_listening(self, host: str, port: int, *, timeout: float = 10) -> None:
        """Wait until a TCP socket listens on `port` in the host's namespace (no connection made,
        so one-shot servers such as `iperf3 -s -1` are not used up)."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.run(host, ["ss", "-Hltn", f"sport = :{port}"], timeout=timeout).stdout
            if out.strip():
                return
            if time.monotonic() > deadline:
                raise TestBedError(f"nothing listens on {host}:{port} after {timeout}s")
            time.sleep(0.05)

    def ssh_argv(self, alias: str, *command: str) -> list[str]:
        """`ssh -F <ssh_config> <alias> [command...]`, for subprocess."""
        return ["ssh", "-F", str(self.ssh_config), alias, *command]

    # --------------------------------------------------------------------- inspection

    def _daemon_pids(self) -> set[int]:
        """The bed's own processes in its namespaces: sshd listeners, Slurm's daemons."""
        keep = {p for h in self._all_hosts() if (p := self._sshd_pid(h))}
        if self.slurm is not None:
            keep |= self.slurm.service_pids()
        return keep

    def leaks(self) -> list[str]:
        """What a test left behind: processes in the bed's namespaces other than the sshd
        listeners, Slurm daemons and the bed's proxies, hosts cut, sshds stopped, rates changed,
        Slurm jobs not finished (pending, running, completing) or nodes not idle."""
        found = []
        keep = self._daemon_pids() | {p.pid for p in self._proxies.values()}
        for ns in list_namespaces():
            if ns.startswith(f"{self.id}-"):
                for pid in namespace_pids(ns):
                    if pid not in keep:
                        found.append(f"process {pid} ({_cmdline(pid)}) in {ns}")
        found += [f"host {h} cut" for h in sorted(self._cut)]
        found += [f"sshd of {h} stopped" for h in sorted(self._stopped)]
        found += [f"rate {'-'.join(sorted(pair))} is {rate}" for pair, rate in
                  self._rates.items() if rate != self.rate_mbit]
        found += [f"rate of {c} is {rate}" for c, rate in self._cluster_rates.items()
                  if rate != self.rate_mbit]
        if self.slurm is not None and not self._cut:
            found += self.slurm.leaks()
        for host in self.hosts.values():
            with contextlib.suppress(FileNotFoundError):
                if lines := self.authorized_keys(host.name).read_text().splitlines():
                    found.append(f"{len(lines)} key line(s) left in {host.name}'s "
                                 f"{self.authorized_keys(host.name).name}")
        return found

    def reset(self) -> None:
        """Undo what leaks() reports: cancel Slurm jobs, kill strays, restore hosts, sshds,
        rates, Slurm daemons and nodes; stop proxies."""
        for proc in [*self._procs, *self._proxies.values()]:
            _stop_popen(proc)
        self._procs.clear()
        self._proxies.clear()
        for host in sorted(self._cut):
            self.restore(host)
        for host in sorted(self._stopped):
            self.start_sshd(host)
        for name in self.hosts:
            self.authorized_keys(name).unlink(missing_ok=True)
        changed = {c for pair, r in self._rates.items() if r != self.rate_mbit for c in pair}
        changed |= {c for c, r in self._cluster_rates.items() if r != self.rate_mbit}
        for pair in self._rates:
            self._rates[pair] = self.rate_mbit
        for c in self._cluster_rates:
            self._cluster_rates[c] = self.rate_mbit
        for cluster in changed:
            self._shape(cluster)
        failed: SlurmError | None = None
        if self.slurm is not None:
            try:
                self.slurm.reset()
            except SlurmError as exc:
                failed = exc
        keep = self._daemon_pids()
        strays = [pid for ns in list_namespaces() if ns.startswith(f"{self.id}-")
                  for pid in namespace_pids(ns) if pid not in keep]
        kill_pids(strays)
        if failed is not None:
            raise TestBedError(f"Slurm of bed {self.id} could not be reset: {failed}")

    def status(self) -> dict:
        return {"id": self.id, "slot": self.slot, "dir": str(self.dir),
                "ssh_config": str(self.ssh_config),
                "hosts": {h.name: {"cluster": h.cluster, "ns": h.ns, "address": h.address}
                          for h in self._all_hosts()},
                "compute": {h.name: {"cluster": h.cluster, "ns": h.ns, "address": h.address}
                            for h in self.compute.values()},
                **({"slurm": self.slurm.describe()} if self.slurm else {}),
                "link": self.link, "tcp": self.tcp,
                "rates_mbit": {"-".join(sorted(p)): r for p, r in self._rates.items()}
                if self.link == "pair" else dict(self._cluster_rates)}

    def _host(self, name: str) -> Host:
        if name == "bastion" and self.bastion:
            return self.bastion
        try:
            return self.hosts.get(name) or self.compute[name]
        except KeyError:
            raise TestBedError(f"no host {name!r} in this bed: "
                               f"{sorted([*self.hosts, *self.compute])}") from None

    def _router_if(self, host: Host) -> str:
        return "rb" if host is self.bastion else f"h{self._host_index[host.name]}"
