"""Plain TCP between N bed hosts in the pattern of a relay round, for bench/relay_goodput.py
--clusters N: one connection per pair of hosts (the later host dials the earlier, as relays
do), socket options as the relay's (relay.wire.tune_socket), and at one instant every
host sends `nbytes` to every other while receiving as much from each (a thread per direction
per connection). What TCP itself makes of the lines for the same bytes, without TLS, framing,
codecs or the round's dependencies: the reference beside the relay's round time.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _bed
import _relays

PORT = 29600
PIECE = 1 << 20


def side(args: argparse.Namespace) -> dict[str, Any]:
    """One host: connect to every other, wait for --start, send and receive --bytes each."""
    from nebula_cli.relay.net.wire import tune_socket

    addrs = args.addrs.split(",")
    me, n = int(args.index), len(addrs)
    conns: dict[int, socket.socket] = {}
    with socket.create_server((addrs[me], PORT), backlog=n) as srv:
        srv.settimeout(60)
        for j in range(me):  # dial the earlier hosts, say who we are
            deadline = time.monotonic() + 60
            while True:
                try:
                    sock = socket.create_connection((addrs[j], PORT), timeout=10)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            tune_socket(sock)
            sock.sendall(bytes([me]))
            conns[j] = sock
        for _ in range(n - 1 - me):  # the later hosts dial us
            sock, _ = srv.accept()
            tune_socket(sock)
            conns[sock.recv(1)[0]] = sock
    for sock in conns.values():
        sock.settimeout(120)
    print("READY", flush=True)
    start = float(sys.stdin.readline().split()[1])  # GO <instant>, once every side is READY
    time.sleep(max(0.0, start - time.time()))
    ends: list[float] = []
    errors: list[str] = []

    def send(sock: socket.socket) -> None:
        data, left = memoryview(bytearray(PIECE)), args.bytes
        try:
            while left:
                left -= sock.send(data[: min(left, PIECE)])
        except OSError as exc:
            errors.append(f"send: {exc}")

    def recv(sock: socket.socket) -> None:
        buf, left = bytearray(PIECE), args.bytes
        try:
            while left:
                k = sock.recv_into(buf, min(left, PIECE))
                if not k:
                    raise OSError("closed early")
                left -= k
            ends.append(time.time())
        except OSError as exc:
            errors.append(f"recv: {exc}")

    threads = [threading.Thread(target=f, args=(s,)) for s in conns.values() for f in (send, recv)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sock in conns.values():
        sock.close()
    if errors:
        raise SystemExit("; ".join(errors))
    return {"end": max(ends)}


def run(bed: Any, tmp: Path, hosts: list[str], nbytes: int, timeout: float) -> float:
    """Seconds from the common start until every host received `nbytes` from every other."""
    addrs = ",".join(bed.hosts[h].address for h in hosts)
    procs = []
    for i, host in enumerate(hosts):
        with open(tmp / f"mesh-{host}.err", "w") as err:
            procs.append(bed.popen(host, [sys.executable, "-u", str(_bed.REPO / "bench" /
                                                                   "relay_goodput.py"),
                                          "--side", "mesh", "--index", str(i), "--addrs", addrs,
                                          "--bytes", str(nbytes)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                   text=True,
                                   cwd=_bed.REPO, env=_relays.env()))
    ends = []
    try:
        for host, proc in zip(hosts, procs, strict=True):
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "READY":  # connected to every other host
                proc.wait(30)
                raise RuntimeError(f"TCP mesh on {host} did not connect: "
                                   f"{(tmp / f'mesh-{host}.err').read_text()[-1500:]}")
        start = time.time() + 0.5
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(f"GO {start:.6f}\n")
            proc.stdin.flush()
        for host, proc in zip(hosts, procs, strict=True):
            out, _ = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"TCP mesh on {host} exited {proc.returncode}: "
                                   f"{(tmp / f'mesh-{host}.err').read_text()[-1500:]}")
            ends.append(json.loads(out.strip().splitlines()[-1])["end"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return max(ends) - start

