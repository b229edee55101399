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

Addresses, all inside 198.18.0.0/15 (nothing else is ever configured or targeted): each live bed
holds one of 8 slots (a /18, slot s starts at 198.18.0.0 + s * 16384); within it /24 number i is
cluster i (in dict order), /24 number 32 the bastion net, /24 number 33 the mgmt net. For slot 0:
east 198.18.0.0/24 (e1 .1, e2 .2, router .254), west 198.18.1.0/24, north 198.18.2.0/24,
bastion 198.18.32.1, root 198.18.33.1, router 198.18.33.2. The root namespace reaches every host
and the bastion directly through the router (route <slot /18> via mgmt .2); hosts have no default
route, so nothing they send can leave the slot.

Reachability: the hosts of a cluster share a bridge (one L2 hop, ping TTL 64); traffic between
clusters is routed by the router (ping TTL 63). ProxyJump is meaningful through the source
address: `ssh -F ssh_config e1` arrives from the root's mgmt address, `ssh -F ssh_config e1-jump`
(ProxyJump bastion) arrives from the bastion's address (see SSH_CONNECTION on the host).

Shaping, htb classes with rate = ceil = R Mbit/s (burst 64 KiB) on the router's two sides of
each cluster link: `r<i>` egress (into cluster i) classifies by source net, `s<i>` egress (out of
cluster i) by destination net; unclassified traffic (mgmt, bastion, inside a cluster) is not
shaped. Two topologies (`link=`):
- "pair" (the default): one class per pair of clusters on each side, so every pair is its own
  link of R each way (a full mesh of independent links; `set_rate(a, b, R)`).
- "cluster": one class of R per side (class 1:1) shared by the traffic to and from every other
  cluster, so each cluster has one uplink and one downlink of R, as a site behind its WAN line
  has (`set_cluster_rate(c, R)`); traffic between a and b is bounded by a's uplink and b's
  downlink. The line is shared fairly between the peer clusters: a child class per peer with
  rate R/(N-1) and ceil R (what a peer leaves idle the others borrow). Without it one TCP flow
  starved another in the line's single FIFO (4 against 25 Mbit/s of 30 in a 3 s test), and
  this kernel has no fq_codel or sfq to queue per flow. With two clusters both modes shape
  alike. Delay-proxied traffic (below) leaves the source cluster towards the router itself, so
  in this mode only the destination cluster's link shapes it.
TCP: the hosts use this machine's congestion control unless `tcp=` names another (one of
tcp_allowed_congestion_control, e.g. "reno"). Here the machine's default is bbr, and the bed adds
no delay: BBR then sizes its window (2 x bandwidth x min RTT) from a min RTT of microseconds
while the shared lines' queues hold a connection's ACKs behind the other direction's data for
hundreds of ms, and a connection can crawl for seconds (1.3 Mbit/s of a 20 Mbit/s line seen,
bench/relay_goodput.py --clusters 4). Linux's default cubic is not allowed inside these
namespaces; "reno", loss-based like cubic, stands in for it (both gave the same round times).
htb instead of a bare `tbf` so that every pair can have its own rate with three or more
clusters. netem does not exist on this kernel: latency comes from `delayed_endpoint()` (a
user-space delay proxy in the router, see delay_proxy.py; its traffic is shaped like the
pair's) or from the relay's own shaping (nebula_cli/relay/shaping.py).

Files: keys, sshd configs, logs, known_hosts and ssh_config live in `<workdir>/<id>/` (default
workdir /tmp/nebula-testbed; it must outlive the bed, as sshd re-reads its config and host key on
every connection: not pytest's tmp_path, which concurrent sessions prune); the state
file (creator pid, slot) in /tmp/nebula-testbed/<id>/state.json. `down()` ends every process in
the bed's namespaces (sshd, proxies, whatever tests started there), deletes the namespaces (and so
every veth and bridge) and the root veth, and removes both directories. `cleanup_stale()` does the
same for beds whose creator process is gone (unless started with `python -m tests.testbed up`).

Slurm (optional, slurm.py): `slurm={"hpc": "login"}` makes `login` the login node and controller
of cluster hpc and its other hosts compute nodes: they run slurmd and no sshd, are not in `hosts`,
ssh_config or known_hosts, but in `compute` (and `run`/`popen`/`cut` accept them). `bed.slurm`
then describes the cluster (conf path, nodes, partitions); its munged is killed by `down()` and
`cleanup_stale()` like the processes in the namespaces.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from . import slurm as slurm_mod
from .slurm import SlurmCluster, SlurmError

STATE_ROOT = Path("/tmp/nebula-testbed")
BENCH_NET = ipaddress.IPv4Network("198.18.0.0/15")
SLOTS = 8
SLOT_SIZE = 1 << 14  # a /18
MAX_CLUSTERS = 32
BASTION_INDEX, MGMT_INDEX = 32, 33
BED_ID = re.compile(r"^nb[0-9a-f]{4}$")
HOST_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
RESERVED_NAMES = {"r", "bastion", "router"}
SSHD = "/usr/sbin/sshd"
DEFAULT_CLUSTERS = {"east": ["e1", "e2"], "west": ["w1", "w2"]}
HOST_IFACE = "eth0"
LINK_MODES = ("pair", "cluster")


class TestBedError(RuntimeError):
    """The test bed could not be built or driven (missing tools, a failed `ip`/`tc` command)."""

    __test__ = False


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


def _sh(cmd: Sequence[str], *, check: bool = True, timeout: float = 30,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                              input=input, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise TestBedError(f"timed out after {timeout}s: {shlex.join(cmd)}") from exc
    if check and proc.returncode != 0:
        raise TestBedError(f"{shlex.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def slot_net(slot: int) -> ipaddress.IPv4Network:
    """The /18 of addresses that bed slot `slot` owns (inside 198.18.0.0/15)."""
    net = ipaddress.IPv4Network((int(BENCH_NET.network_address) + slot * SLOT_SIZE, 18))
    if not 0 <= slot < SLOTS or not net.subnet_of(BENCH_NET):
        raise TestBedError(f"slot {slot} outside 198.18.0.0/15")
    return net


def subnet(slot: int, index: int) -> ipaddress.IPv4Network:
    """/24 number `index` of a slot: clusters 0..31, bastion 32, mgmt 33."""
    return list(slot_net(slot).subnets(new_prefix=24))[index]


def _addr(net: ipaddress.IPv4Network, host: int) -> str:
    return str(net.network_address + host)


# ---------------------------------------------------------------- namespaces and processes

def list_namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    out = _sh(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def kill_pids(pids: Sequence[int], *, grace: float = 3.0) -> None:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL whatever is left (bounded)."""
    pids = [p for p in pids if p != os.getpid()]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 3.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while (pids := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not pids:
            return


def destroy(bed_id: str, *, dirs: Sequence[Path] = ()) -> None:
    """Remove everything bed `bed_id` may have made: processes, namespaces, root veth, dirs."""
    if not BED_ID.match(bed_id):
        raise TestBedError(f"not a test bed id: {bed_id!r}")
    namespaces = [ns for ns in list_namespaces() if ns.startswith(f"{bed_id}-")]
    pids = [pid for ns in namespaces for pid in namespace_pids(ns)]
    kill_pids([pid for pid in pids if _cmdline(pid).startswith("slurmstepd")], grace=0.2)
    kill_pids(pids)
    state = None
    with contextlib.suppress(OSError, ValueError):
        state = json.loads((STATE_ROOT / bed_id / "state.json").read_text())
    slurm_mod.kill_root_daemons(bed_id, state)  # munged, in the root namespace
    for ns in namespaces:
        _sh(["ip", "netns", "del", ns], check=False)
    if Path(f"/sys/class/net/{bed_id}").exists():
        _sh(["ip", "link", "del", bed_id], check=False)
    for directory in (*dirs, STATE_ROOT / bed_id):
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(STATE_ROOT / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_states() -> dict[str, dict]:
    """State of every bed recorded under /tmp/nebula-testbed (id -> state dict)."""
    states = {}
    for path in sorted(STATE_ROOT.glob("nb*/state.json")):
        with contextlib.suppress(OSError, ValueError):
            states[path.parent.name] = json.loads(path.read_text())
    return states


def is_stale(state: dict) -> bool:
    """Whether a recorded bed's creator is gone (dead, a zombie, or its pid reused)."""
    if state.get("manual"):
        return False
    pid = state.get("pid")
    return not (isinstance(pid, int) and _alive(pid) and _start_time(pid) == state.get("pid_start"))


def cleanup_stale(*, include_manual: bool = False) -> list[str]:
    """Destroy beds whose creator process is gone, and `nb<4hex>` leftovers with no state.

    Beds made by `python -m tests.testbed up` are kept unless include_manual. Returns their ids.
    """
    removed = []
    with _state_lock():
        states = read_states()
        for bed_id, state in states.items():
            if is_stale(state) or (include_manual and state.get("manual")):
                destroy(bed_id, dirs=[Path(state["dir"])] if state.get("dir") else [])
                removed.append(bed_id)
        orphans = {ns.split("-", 1)[0] for ns in list_namespaces() if "-" in ns}
        orphans |= {p.name for p in Path("/sys/class/net").iterdir()}
        for bed_id in sorted(o for o in orphans if BED_ID.match(o) and o not in states):
            destroy(bed_id)
            removed.append(bed_id)
    return removed


# ---------------------------------------------------------------------------- the bed

class TestBed:
    """Clusters of SSH hosts in network namespaces, joined by a shaped router. See module doc."""

    __test__ = False  # not a pytest test class

    def __init__(self, clusters: dict[str, list[str]] | None = None, *,
                 rate_mbit: float | None = 100, bastion: bool = True,
                 workdir: Path | None = None, slurm: dict[str, str] | None = None,
                 link: str = "pair", tcp: str | None = None) -> None:
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
                                       if h != login])
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

    # ------------------------------------------------------------------------ shaping

    def _shape(self, cluster: str) -> None:
        """(Re)build the htb qdiscs on both router sides of `cluster`'s link from the rates."""
        names = list(self.clusters)
        i = names.index(cluster)
        for dev, direction in ((f"r{i}", "src"), (f"s{i}", "dst")):
            tc = ["ip", "netns", "exec", self.router_ns, "tc"]
            _sh([*tc, "qdisc", "del", "dev", dev, "root"], check=False)
            _sh([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"])
            line = self._cluster_rates.get(cluster) if self.link == "cluster" else None
            if line is not None:  # this cluster's line, shared fairly by its peers
                self._htb_class(dev, "1:1", "1:", line, line)
            for j, other in enumerate(names):
                classid = f"1:{10 + j:x}"
                if other == cluster:
                    continue
                if self.link == "cluster":
                    if line is None:
                        continue
                    self._htb_class(dev, classid, "1:1", line / (len(names) - 1), line)
                else:
                    rate = self._rates.get(frozenset((cluster, other)))
                    if rate is None:
                        continue
                    self._htb_class(dev, classid, "1:", rate, rate)
                _sh([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                     "prio", "1", "u32", "match", "ip", direction,
                     str(subnet(self.slot or 0, j)), "flowid", classid])

    def _htb_class(self, dev: str, classid: str, parent: str, mbit: float, ceil: float
                   ) -> None:
        _sh(["ip", "netns", "exec", self.router_ns, "tc", "class", "add", "dev", dev,
             "parent", parent, "classid", classid, "htb", "rate", f"{mbit}mbit",
             "ceil", f"{ceil}mbit", "burst", "64k", "cburst", "64k", "quantum", "60000"])

    def set_rate(self, cluster_a: str, cluster_b: str, mbit: float | None) -> None:
        """Shape traffic between two clusters to `mbit` Mbit/s each way (None: unshaped);
        link "pair" only (a "cluster" bed has `set_cluster_rate`)."""
        if self.link != "pair":
            raise TestBedError("set_rate is for link='pair' beds; this bed has one link per "
                               "cluster: use set_cluster_rate(cluster, mbit)")
        if cluster_a == cluster_b or {cluster_a, cluster_b} - set(self.clusters):
            raise TestBedError(f"need two different clusters of {list(self.clusters)}")
        if mbit is not None and mbit <= 0:
            raise TestBedError(f"rate must be positive or None, got {mbit}")
        self._rates[frozenset((cluster_a, cluster_b))] = mbit
        self._shape(cluster_a)
        self._shape(cluster_b)

    def set_cluster_rate(self, cluster: str, mbit: float | None) -> None:
        """Shape `cluster`'s line (its traffic to all other clusters, and from them) to `mbit`
        Mbit/s each way (None: unshaped); link "cluster" only."""
        if self.link != "cluster":
            raise TestBedError("set_cluster_rate is for link='cluster' beds; this bed has a "
                               "link per pair: use set_rate(a, b, mbit)")
        if cluster not in self.clusters:
            raise TestBedError(f"unknown cluster {cluster!r} (of {list(self.clusters)})")
        if mbit is not None and mbit <= 0:
            raise TestBedError(f"rate must be positive or None, got {mbit}")
        self._cluster_rates[cluster] = mbit
        self._shape(cluster)

    def rate(self, cluster_a: str, cluster_b: str) -> float | None:
        """Mbit/s between two clusters each way (None: unshaped); link "cluster": the slower of
        the two clusters' lines (what one flow between them alone gets)."""
        if self.link == "pair":
            return self._rates[frozenset((cluster_a, cluster_b))]
        rates = [r for r in (self._cluster_rates[cluster_a], self._cluster_rates[cluster_b])
                 if r is not None]
        return min(rates) if rates else None

    def cluster_rate(self, cluster: str) -> float | None:
        """Mbit/s of a cluster's line each way (link "cluster" beds)."""
        if self.link != "cluster":
            raise TestBedError("cluster_rate is for link='cluster' beds")
        return self._cluster_rates[cluster]

    # --------------------------------------------------------------------------- ssh

    def _write_ssh_files(self) -> None:
        lines = []
        for host in self._all_hosts():
            key = self.dir / host.name / "ssh_host_ed25519_key"
            key.parent.mkdir(mode=0o700, exist_ok=True)
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.id}-{host.name}",
                 "-f", str(key)])
            kind, blob = key.with_suffix(".pub").read_text().split()[:2]
            lines.append(f"{host.address} {kind} {blob}\n")
        self.known_hosts.write_text("".join(lines))

        def block(alias: str, host: Host, jump: bool) -> str:
            return "\n".join([
                f"Host {alias}", f"  HostName {host.address}", "  User root",
                f"  Port {host.ssh_port}", f"  IdentityFile {self.user_key}",
                "  IdentitiesOnly yes", f"  UserKnownHostsFile {self.known_hosts}",
                "  GlobalKnownHostsFile /dev/null", "  StrictHostKeyChecking yes",
                "  BatchMode yes", "  ConnectTimeout 10", "  LogLevel ERROR",
                *(["  ProxyJump bastion"] if jump else []), "", ""])

        text = f"# nebula test bed {self.id}: ssh -F {self.ssh_config} <alias>\n\n"
        for host in self._all_hosts():
            text += block(host.name, host, jump=False)
        if self.bastion:
            for host in self.hosts.values():
                text += block(f"{host.name}-jump", host, jump=True)
        self.ssh_config.write_text(text)

    def _write_sshd_config(self, host: Host) -> None:
        hdir = self.dir / host.name
        (hdir / "sshd_config").write_text("\n".join([
            f"# nebula test bed {self.id}: sshd of {host.name}",
            f"ListenAddress {host.address}:{host.ssh_port}",
            f"HostKey {hdir / 'ssh_host_ed25519_key'}",
            f"PidFile {hdir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.user_key}.pub {self.authorized_keys(host.name)}",
            "StrictModes no", "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
            "X11Forwarding no", "AllowTcpForwarding yes", "PrintMotd no", "PrintLastLog no",
            "UseDNS no", "LoginGraceTime 30",  # MaxSessions, MaxStartups: stock (10, 10:30:100)
            f"SetEnv NEBULA_TESTBED_HOST={host.name} NEBULA_TESTBED_CLUSTER={host.cluster}"
            + (f" SLURM_CONF={self.slurm.conf}"
               if self.slurm and host.name == self.slurm.login.name else ""),
            "Subsystem sftp internal-sftp", "",
        ]))

    def authorized_keys(self, host: str) -> Path:
        """A second AuthorizedKeysFile of the host's sshd, empty unless a test writes it (all
        hosts share root's home: a spec's `authorized_keys` names this file instead)."""
        return self.dir / host / "authorized_keys"

    def _sshd_pid(self, host: Host) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            pid = int((self.dir / host.name / "sshd.pid").read_text().strip())
            if _alive(pid):
                return pid
        return None

    def start_sshd(self, host: str) -> None:
        """Start the host's sshd and wait until it accepts connections."""
        h = self._host(host)
        if not h.sshd:
            raise TestBedError(f"{host} is a Slurm compute node: it has no sshd")
        if self._sshd_pid(h) is None:
            hdir = self.dir / h.name
            _sh(["ip", "netns", "exec", h.ns, SSHD, "-f", str(hdir / "sshd_config"),
                 "-E", str(hdir / "sshd.log")])
        self._stopped.discard(h.name)
        if h.name not in self._cut:
            self.wait_listening(h.name, h.ssh_port)

    def stop_sshd(self, host: str) -> None:
        """Stop the host's listening sshd (sessions already open keep running)."""
        h = self._host(host)
        pid = self._sshd_pid(h)
        if pid is not None:
            kill_pids([pid])
        self._stopped.add(h.name)

    # ---------------------------------------------------------------- faults and access

    def cut(self, host: str) -> None:
        """Take the host's link down: it keeps running but nothing reaches it and it reaches
        nothing (connections to it hang rather than being refused)."""
        h = self._host(host)
        _sh(["ip", "-n", h.ns, "link", "set", HOST_IFACE, "down"])
        self._ip_r("link", "set", self._router_if(h), "down")
        self._cut.add(h.name)

    def partition(self, host: str) -> None:
        """Cut the host off at the router: it still reaches itself (its own address), but
        nothing crosses between it and any other host (a WAN link cut). `restore` heals it."""
        h = self._host(host)
        self._ip_r("link", "set", self._router_if(h), "down")
        self._cut.add(h.name)

    def restore(self, host: str) -> None:
        """Bring a cut host's link (and its route) back."""
        h = self._host(host)
        self._ip_r("link", "set", self._router_if(h), "up")
        net = ipaddress.IPv4Network(f"{h.address}/24", strict=False)
        self._link_up(h, _addr(net, 254))
        self._cut.discard(h.name)

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

    # -------------------------------------------------------------------- delay proxies

    def delayed_endpoint(self, src_cluster: str, dst_host: str, dst_port: int,
                         delay_ms: float) -> tuple[str, int]:
        """Start a delay proxy in the router that hosts of `src_cluster` dial instead of
        dst_host:dst_port; each direction gets `delay_ms` more one-way delay (a round trip
        2 x delay_ms). Returns the (address, port) to dial. The proxy's traffic is shaped like
        direct traffic between src_cluster and dst_host's cluster. Stopped by down()."""
        if src_cluster not in self.clusters:
            raise TestBedError(f"unknown cluster {src_cluster!r}")
        dst = self._host(dst_host)
        i = list(self.clusters).index(src_cluster)
        listen = _addr(subnet(self.slot or 0, i), 254)
        script = Path(__file__).with_name("delay_proxy.py")
        with open(self.dir / "delay_proxy.log", "a") as log:
            proc = subprocess.Popen(
                [*self.exec_prefix("router"), sys.executable, str(script),
                 "--listen", f"{listen}:0", "--target", f"{dst.address}:{dst_port}",
                 "--delay-ms", str(delay_ms), "--source", listen],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True)
        line = _readline(proc, timeout=10)
        parts = line.split()
        if len(parts) != 3 or parts[0] != "LISTENING":
            _stop_popen(proc)
            raise TestBedError(f"delay proxy did not start (said {line!r}); "
                               f"see {self.dir / 'delay_proxy.log'}")
        endpoint = (parts[1], int(parts[2]))
        self._proxies[endpoint] = proc
        return endpoint

    def close_endpoint(self, endpoint: tuple[str, int]) -> None:
        """Stop the delay proxy behind an endpoint from delayed_endpoint()."""
        proc = self._proxies.pop((endpoint[0], endpoint[1]), None)
        if proc is not None:
            _stop_popen(proc)

    # --------------------------------------------------------------------- inspection

    def end_stale_sessions(self, host: str) -> list[int]:
        """Kill the sshd session processes of `host` (not its listener): after a cut, the
        sessions of the dead connections linger until sshd notices, which is not a leak of the
        code under test."""
        listener = self._sshd_pid(self._host(host))
        stale = [pid for pid in namespace_pids(self._host(host).ns)
                 if pid != listener and _cmdline(pid).startswith("sshd: ")]
        kill_pids(stale)
        return stale

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


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def _stop_popen(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=3)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _readline(proc: subprocess.Popen, *, timeout: float) -> str:
    """One line of proc's stdout, waiting at most `timeout` seconds ("" on timeout or EOF)."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return ""
    return proc.stdout.readline().strip()


def port_open(address: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a TCP connect from this namespace to address:port succeeds (198.18/15 only)."""
    if ipaddress.IPv4Address(address) not in BENCH_NET:
        raise TestBedError(f"{address} is outside 198.18.0.0/15")
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False
