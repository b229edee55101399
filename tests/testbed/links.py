"""The links between the test bed's clusters: rates (tc htb in the router) and latency (delay
proxies), cuts of a host's link; a mixin of TestBed.

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
pair's) or from the relay's own shaping (nebula_cli/relay/net/shaping.py).
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from pathlib import Path

from .system import HOST_IFACE, TestBedError, _addr, _readline, _sh, _stop_popen, subnet


class Links:
    """TestBed's links between clusters (needs its clusters, router, slot, rates, hosts)."""

    clusters: dict[str, list[str]]
    link: str
    router_ns: str
    slot: int | None
    dir: Path
    _rates: dict[frozenset[str], float | None]
    _cluster_rates: dict[str, float | None]
    _proxies: dict[tuple[str, int], subprocess.Popen]
    _cut: set[str]

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

    # ------------------------------------------------------------------------- cuts

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
