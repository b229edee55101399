"""Relay goodput on loopback: an fp32 model averaged through two relays (mutual TLS, codec none)
against the same bytes over a raw TCP socket.

    .venv/bin/python bench/relay_loopback.py [--mb 256] [--repeat 3] [--json]

Rows (best of --repeat; GB/s of fp32 model bytes; ratio = row / raw TCP):
- raw TCP, 1 stream: --mb one way, sendall of 16 MiB memoryviews, recv_into (threads).
- TLS 1.3, 1 stream / 2 streams: the same through the job PKI's contexts (what the relay uses).
- TLS 1.3 duplex, 2 processes: one connection between two processes, each sending --mb while
  receiving --mb (a reader and a writer thread each): the ceiling of the relays' WAN hop.
- relay WAN hop: two relay processes exchange --mb each way at once (the relays' own round time:
  agreement + encode + send + receive + decode + average).
- relay end to end: RelayClient.allreduce on both clusters at once, wall time (adds the local
  TLS hop to and from each relay).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nebula_cli.config.spec import CompressionSpec, RelaySpec  # noqa: E402
from nebula_cli.pki import JobPKI, client_context, issue_job_pki, server_context  # noqa: E402
from nebula_cli.relay.client import RelayClient, tune_buffers  # noqa: E402
from nebula_cli.relay.config import RelayConfig, ShapingConfig  # noqa: E402

PIECE = 16 << 20


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def stream(total: int, pki: JobPKI | None, streams: int = 1) -> tuple[float, str]:
    """GB/s of ``total`` bytes from one thread per stream to one receiver thread per stream."""
    ls = socket.create_server(("127.0.0.1", 0), backlog=streams)
    sctx = server_context(pki.relay("a"), pki.ca_cert) if pki else None
    cctx = client_context(pki.relay("b"), pki.ca_cert) if pki else None
    per = total // streams
    data = memoryview(bytearray(PIECE))
    got: list[int] = []
    ready = threading.Barrier(streams + 1)
    cipher = ["plain TCP"]

    def receive(conn: socket.socket) -> None:
        buf = memoryview(bytearray(PIECE))
        n = 0
        with conn:
            if sctx is not None:
                conn = sctx.wrap_socket(conn, server_side=True)
            ready.wait(30)
            while n < per:
                k = conn.recv_into(buf)
                if not k:
                    break
                n += k
        got.append(n)

    def accept() -> None:
        for _ in range(streams):
            conn, _ = ls.accept()
            tune_buffers(conn)
            threading.Thread(target=receive, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    socks = []
    try:
        for _ in range(streams):
            s = socket.create_connection(ls.getsockname(), timeout=30)
            tune_buffers(s)
            if cctx is not None:
                s = cctx.wrap_socket(s)
                cipher[0] = s.cipher()[0]
            socks.append(s)
        ready.wait(30)
        t0 = time.perf_counter()

        def send(s: socket.socket) -> None:
            sent = 0
            while sent < per:
                n = min(PIECE, per - sent)
                s.sendall(data[:n])
                sent += n

        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(send, socks))
        end = time.monotonic() + 60
        while len(got) < streams and time.monotonic() < end:
            time.sleep(0.001)
        dt = time.perf_counter() - t0
    finally:
        for s in socks:
            s.close()
        ls.close()
    if sum(got) != per * streams:
        raise RuntimeError(f"received {sum(got)} of {per * streams} bytes")
    return sum(got) / dt / 1e9, cipher[0]


def _duplex_side(server: bool, port: int, pki_dir: str, total: int, q: mp.Queue) -> None:
    from nebula_cli.pki import load_pki

    pki = load_pki(Path(pki_dir))
    if server:
        ls = socket.create_server(("127.0.0.1", port))
        q.put("listening")
        raw, _ = ls.accept()
        ls.close()
        tune_buffers(raw)
        sock = server_context(pki.relay("a"), pki.ca_cert).wrap_socket(raw, server_side=True)
    else:
        raw = socket.create_connection(("127.0.0.1", port), timeout=30)
        tune_buffers(raw)
        sock = client_context(pki.relay("b"), pki.ca_cert).wrap_socket(raw)
    sock.settimeout(None)
    data = memoryview(bytearray(PIECE))

    def receive() -> None:
        buf = memoryview(bytearray(PIECE))
        n = 0
        while n < total:
            k = sock.recv_into(buf)
            if not k:
                break
            n += k

    t0 = time.perf_counter()
    reader = threading.Thread(target=receive)
    reader.start()
    for off in range(0, total, PIECE):
        sock.sendall(data[: min(PIECE, total - off)])
    reader.join()
    q.put(time.perf_counter() - t0)
    sock.close()


def duplex(total: int, pki: JobPKI) -> float:
    """GB/s per direction with both directions of one TLS connection busy (two processes)."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    port = free_ports(1)[0]
    server = ctx.Process(target=_duplex_side, args=(True, port, str(pki.root), total, q))
    server.start()
    procs = [server]
    try:
        if q.get(timeout=60) != "listening":
            raise RuntimeError("duplex server did not start")
        client = ctx.Process(target=_duplex_side, args=(False, port, str(pki.root), total, q))
        client.start()
        procs.append(client)
        times = [q.get(timeout=300) for _ in range(2)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    return total / max(times) / 1e9


def relay_rounds(mb: int, repeat: int, tmp: Path, pki: JobPKI) -> tuple[list[float], list[float]]:
    """Two relay processes; ``repeat`` rounds of an ``mb`` MB fp32 model on both clusters."""
    clusters = ["a", "b"]
    ports = free_ports(4)
    peer = {c: f"127.0.0.1:{ports[2 * i]}" for i, c in enumerate(clusters)}
    work = {c: f"127.0.0.1:{ports[2 * i + 1]}" for i, c in enumerate(clusters)}
    procs = []
    clients: dict[str, RelayClient] = {}
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "NEBULA_RELAY_LOG": os.environ.get("NEBULA_RELAY_LOG", "WARNING")}
    try:
        for c in clusters:
            pair = pki.relay(c)
            cfg = RelayConfig(
                job_id="bench", cluster=c, clusters=clusters, peer_listen=peer[c],
                worker_listen=work[c], peers={o: peer[o] for o in clusters if o != c},
                tls={"ca": str(pki.ca_cert), "cert": str(pair.cert), "key": str(pair.key)},
                codec="none", error_feedback=False, block_size=CompressionSpec().block_size,
                round_timeout=120.0,
                heartbeat=RelaySpec().heartbeat, dead_after=RelaySpec().dead_after,
                shaping=ShapingConfig(rate_mbit=None, delay_ms=0.0), auto_steps=None,
                metrics_file=str(tmp / f"metrics-{c}.jsonl"))
            cfg.dump(tmp / f"relay-{c}.json")
            log = open(tmp / f"relay-{c}.log", "wb")  # noqa: SIM115 (closed with the process)
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "nebula_cli.relay.server", "--config",
                 str(tmp / f"relay-{c}.json")], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, cwd=REPO), log))
            w = pki.worker(c, "h0")
            clients[c] = RelayClient(work[c], ca=pki.ca_cert, cert=w.cert, key=w.key,
                                     job_id="bench", cluster=c, round_timeout=120.0,
                                     retry_for=60.0)
        numel = mb * (1 << 20) // 4
        xs = {c: torch.randn(numel) for c in clusters}
        walls, relay_s = [], []
        with ThreadPoolExecutor(2) as pool:
            warm = {c: pool.submit(clients[c].allreduce, 0, xs[c]) for c in clusters}
            for f in warm.values():  # connects, registers the size, warms the allocator
                f.result(timeout=600)
            for r in range(1, repeat + 1):
                t0 = time.perf_counter()
                futs = {c: pool.submit(clients[c].allreduce, r, xs[c]) for c in clusters}
                res = {c: f.result(timeout=600) for c, f in futs.items()}
                walls.append(time.perf_counter() - t0)
                relay_s.append(max(x.seconds for x in res.values()))
                if not torch.equal(res["a"].tensor, res["b"].tensor):
                    raise RuntimeError("the two clusters got different averages")
        return walls, relay_s
    finally:
        for cl in clients.values():
            cl.close()
        for p, log in procs:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            log.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="model size in MB (fp32), >= 256 counts")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    logging.getLogger("nebula").setLevel(logging.ERROR)  # "relay not up yet, retrying"
    total = args.mb << 20
    with tempfile.TemporaryDirectory(prefix="nebula-bench-") as d:
        tmp = Path(d)
        pki = issue_job_pki("bench", {"a": ["h0"], "b": ["h0"]}, tmp / "pki",
                            valid_for=datetime.timedelta(days=1))
        rows: list[tuple[str, float, str]] = []
        best_raw = max(stream(total, None)[0] for _ in range(args.repeat))
        rows.append(("raw TCP, 1 stream", best_raw, "plain"))
        tls1 = [stream(total, pki) for _ in range(args.repeat)]
        rows.append(("TLS 1.3, 1 stream", max(g for g, _ in tls1), tls1[0][1]))
        tls2 = [stream(total, pki, 2) for _ in range(args.repeat)]
        rows.append(("TLS 1.3, 2 streams", max(g for g, _ in tls2), tls2[0][1]))
        both = max(duplex(total, pki) for _ in range(args.repeat))
        rows.append(("TLS 1.3 duplex, 2 processes", both, "per direction, both at once"))
        walls, relay_s = relay_rounds(args.mb, args.repeat, tmp, pki)
        rows.append(("relay WAN hop (both ways at once)", total / min(relay_s) / 1e9,
                     f"median {total / statistics.median(relay_s) / 1e9:.2f}"))
        rows.append(("relay end to end (allreduce)", total / min(walls) / 1e9,
                     f"median {total / statistics.median(walls) / 1e9:.2f}"))
    width = max(len(r[0]) for r in rows)
    print(f"{'path':<{width}}  {'GB/s':>6}  {'vs raw':>6}  note")
    for name, gbs, note in rows:
        print(f"{name:<{width}}  {gbs:6.2f}  {gbs / best_raw:6.2f}  {note}")
    print(f"({args.mb} MB fp32, best of {args.repeat}; {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.2f}; {ssl.OPENSSL_VERSION})")
    if args.json:
        print(json.dumps({"mb": args.mb, "repeat": args.repeat, "cores": os.cpu_count(),
                          "load_average": os.getloadavg()[0],
                          "rows": {name: {"gb_s": round(g, 3), "ratio": round(g / best_raw, 3),
                                          "note": note} for name, g, note in rows}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
