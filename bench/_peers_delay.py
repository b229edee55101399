"""The 50 ms of bench/peers.py: every TCP connection between the bed's clusters, of every system,
through one transparent delaying proxy in the bed's router.

netem does not exist in this kernel, and the bed's own delay proxy (tests/testbed/delay_proxy.py,
`TestBed.delayed_endpoint`) serves one fixed endpoint: fine for a relay that is told where to
dial, useless for gloo's full mesh, torchft's lighthouse, managers and store, or hivemind's
libp2p daemons, which dial addresses they learn at run time. So the router's nftables NAT
(prerouting, new connections only) sends every TCP connection from cluster i's /24 to another
cluster's /24 to one local port on the router's address in cluster i's net (`r<i>`'s, .254),
where this proxy reads the connection's original destination (SO_ORIGINAL_DST) and connects
there from that same address. Each direction of each stream is then
`tests/testbed/delay_proxy.Stream`: a delay line that hands every chunk on `delay_ms` after it
was read, without stopping reading (the throughput of the stream is kept). Matched by address,
not by interface: routed packets enter the router through the cluster's bridge (`b<i>`), and
bridged packets must not meet the NAT on their way through a bridge (br_netfilter), so
`install` turns bridge-nf-call-iptables off in the router's namespace (the bed's own; nothing
of the bed uses it).

Shaping and counting are unchanged by the detour: the proxy's packets to cluster j leave
through `r<j>` with a source address in cluster i's net (htb class by source net), and its
replies to the client leave through `r<i>` with the original destination as source, as routed
packets do. So `_bed.link_bytes` (the `r<j>` leaf classes) counts the bytes between the
clusters the same way with or without the proxy, for every system (checked: 5.24 MB across
the 20 Mbit/s link both ways, and a one-byte ping-pong's round trip 50.7 ms at 25 ms).

    python _peers_delay.py --listen-port P --delay-ms 25   (inside the router's namespace)

prints `LISTENING <port>` once it accepts connections; SIGTERM/SIGINT end it and every stream.
`install(bed, delay_ms)` starts it in a bed's router and adds the nftables rules (removed with
the router's namespace when the bed goes down; `remove(bed, proc)` takes them out earlier).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
TABLE = "nebula_bench_delay"
PORT = 39999
POLL = 0.2


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where the client meant to connect before the NAT redirect (IPv4 sockaddr_in)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


def serve(port: int, delay_ms: float, stop: threading.Event, max_buffer: int = 64 << 20) -> None:
    """Accept redirected streams on `port` and proxy each to its original destination."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from testbed.delay_proxy import Stream

    streams: set[Any] = set()
    lock = threading.Lock()

    def done(stream: Any) -> None:
        with lock:
            streams.discard(stream)

    server = socket.create_server(("0.0.0.0", port), backlog=256)
    server.settimeout(POLL)
    print(f"LISTENING {server.getsockname()[1]}", flush=True)
    try:
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            try:
                target = original_destination(client)
                source = client.getsockname()[0]
                upstream = socket.create_connection(target, timeout=10,
                                                    source_address=(source, 0))
            except OSError as exc:
                print(f"delay: cannot proxy a stream: {exc}", file=sys.stderr, flush=True)
                client.close()
                continue
            for sock in (client, upstream):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream = Stream(client, upstream, delay_ms / 1000.0, max_buffer, done)
            with lock:
                streams.add(stream)
    finally:
        server.close()
        with lock:
            remaining = list(streams)
        for stream in remaining:
            stream.close()


def rules(bed: Any, port: int) -> str:
    """The nftables script: a redirect per ordered pair of clusters (new TCP connections only;
    NAT sees a connection's first packet, so the proxy's own replies are never redirected)."""
    import ipaddress

    nets = {c: ipaddress.IPv4Network(f"{bed.hosts_of(c)[0].address}/24", strict=False)
            for c in bed.clusters}
    lines = [f"table ip {TABLE} {{", "  chain pre {",
             "    type nat hook prerouting priority dstnat; policy accept;"]
    for src, src_net in nets.items():
        gateway = src_net.network_address + 254  # the router's address in the client's net
        for dst, net in nets.items():
            if dst != src:
                lines.append(f"    ip saddr {src_net} ip daddr {net} meta l4proto tcp "
                             f"dnat to {gateway}:{port}")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def install(bed: Any, delay_ms: float, port: int = PORT) -> subprocess.Popen:
    """Start the proxy in the bed's router, then redirect the clusters' TCP through it."""
    from testbed.system import _readline

    with open(bed.dir / "peers_delay.log", "a") as log:  # the child keeps its own descriptor
        proc = bed.popen("router", [sys.executable, "-u", str(Path(__file__).resolve()),
                                    "--listen-port", str(port), "--delay-ms", str(delay_ms)],
                         stdout=subprocess.PIPE, stderr=log, text=True)
    line = _readline(proc, timeout=15)
    if not line.startswith("LISTENING"):
        proc.terminate()
        raise RuntimeError(f"the delay proxy did not start (said {line!r}); see "
                           f"{bed.dir / 'peers_delay.log'}")
    # bridged packets must not meet the NAT rules on their way through a cluster's bridge
    # (br_netfilter): only once routed, on r<i>; the router's own namespace, gone with the bed
    bed.run("router", ["sh", "-c", "f=/proc/sys/net/bridge/bridge-nf-call-iptables; "
                                   "[ ! -e $f ] || echo 0 > $f"], check=True)
    bed.run("router", ["nft", "-f", "-"], input=rules(bed, port), check=True)
    return proc


def remove(bed: Any, proc: subprocess.Popen) -> None:
    """Take the redirect out and stop the proxy (the bed's down() does both too)."""
    bed.run("router", ["nft", "delete", "table", "ip", TABLE])
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen-port", type=int, default=PORT)
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay per direction")
    args = p.parse_args(argv)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    serve(args.listen_port, args.delay_ms, stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
