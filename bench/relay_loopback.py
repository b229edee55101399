"""Relay goodput on loopback: an fp32 model averaged through two relays (codec none, mutual
TLS then AES-GCM records between the relays, as they run) against the same bytes over a raw TCP
socket, and where a round's time goes.

    .venv/bin/python bench/relay_loopback.py [--mb 256] [--repeat 3] [--quick] [--json]

Rows (GB/s of fp32 model bytes, best of --repeat, the median beside it; ratio = best / the best
raw TCP of the same run):
- raw TCP, 1 stream: --mb one way, sendall of 16 MiB memoryviews, recv_into (threads).
- TLS 1.3, 1 stream / 2 streams: the same through the job PKI's contexts (what the relay uses).
- TLS 1.3 duplex, 2 processes: one connection between two processes, each sending --mb while
  receiving --mb (a reader and a writer thread each): the ceiling of a WAN hop on TLS.
- records duplex, 2 processes: the same after the relays' switch from TLS to AES-GCM records
  (relay.records: keys agreed inside TLS, 4 MiB records): the ceiling of the relays' WAN hop.
- relay WAN hop: two relay processes exchange --mb each way at once (the relays' own round time:
  agreement + encode + send + receive + decode + average).
- relay end to end, worker on the relay's host: RelayClient.allreduce on both clusters at once,
  wall time, through each relay's Unix socket (tensors in memfds): what rank 0 gets when
  it runs on its relay's gateway (the default).
- relay end to end, worker on another host: the same over mutual TLS on the worker port.

Then the stages of a round side by side (seconds, median and min-max over the repeats; the
slower cluster's): the worker writing its contribution (send), the relay reading it (upload),
the relay's round (agreement, exchange, average), the worker reading the result (receive).
--json prints one JSON object last: end_to_end_vs_tcp (the local row / raw TCP),
end_to_end_tls_vs_tcp, tls_vs_tcp (TLS 1 stream / raw TCP), wan_hop_vs_tcp, duplex_vs_tcp,
records_duplex_vs_tcp, the rows and the stages. --quick: 64 MB, 2 repeats (about 30 s; the
ratios move by a few hundredths from run to run on a loaded machine).
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
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nebula_cli.config.codec_knobs import FEEDBACK_DECAY  # noqa: E402
from nebula_cli.config.relay_config import RelayConfig, ShapingConfig  # noqa: E402
from nebula_cli.config.spec import CompressionSpec, RelaySpec  # noqa: E402
from nebula_cli.pki import JobPKI, client_context, issue_job_pki, server_context  # noqa: E402
from nebula_cli.relay.process.client import RelayClient, tune_socket  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _relays  # noqa: E402

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
            tune_socket(conn)
            threading.Thread(target=receive, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    socks = []
    try:
        for _ in range(streams):
            s = socket.create_connection(ls.getsockname(), timeout=30)
            tune_socket(s)
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


def _duplex_side(server: bool, port: int, pki_dir: str, total: int, q: mp.Queue,
                 records: bool = False) -> None:
    from nebula_cli.pki import load_pki
    from nebula_cli.relay.net import gcm_records as rec

    pki = load_pki(Path(pki_dir))
    if server:
        ls = socket.create_server(("127.0.0.1", port))
        q.put("listening")
        raw, _ = ls.accept()
        ls.close()
        tune_socket(raw)
        sock = server_context(pki.relay("a"), pki.ca_cert).wrap_socket(raw, server_side=True)
    else:
        raw = socket.create_connection(("127.0.0.1", port), timeout=30)
        tune_socket(raw)
        sock = client_context(pki.relay("b"), pki.ca_cert).wrap_socket(raw)
    sock.settimeout(None)
    io: Any = sock
    if records:  # as two relays do after their HELLO: a key each way inside TLS, then unwrap
        key, offer = rec.offer()
        sock.sendall(bytes.fromhex(offer["key"]))
        peer = bytearray(rec.KEY_BYTES)
        got = 0
        while got < len(peer):
            got += sock.recv_into(memoryview(peer)[got:])
        io = rec.RecordConn(rec.unwrap(sock), key, bytes(peer))
    data = memoryview(bytearray(PIECE))

    def receive() -> None:
        buf = memoryview(bytearray(PIECE))
        n = 0
        while n < total:
            k = io.recv_into(buf)
            if not k:
                break
            n += k

    t0 = time.perf_counter()
    reader = threading.Thread(target=receive)
    reader.start()
    for off in range(0, total, PIECE):
        io.sendall(data[: min(PIECE, total - off)])
    reader.join()
    q.put(time.perf_counter() - t0)
    io.close()


def duplex(total: int, pki: JobPKI, records: bool = False) -> float:
    """GB/s per direction with both directions of one TLS connection busy (two processes);
    ``records``: on AES-GCM records after the handshake, as the relays' link."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    port = free_ports(1)[0]
    server = ctx.Process(target=_duplex_side,
                         args=(True, port, str(pki.root), total, q, records))
    server.start()
    procs = [server]
    try:
        if q.get(timeout=60) != "listening":
            raise RuntimeError("duplex server did not start")
        client = ctx.Process(target=_duplex_side,
                             args=(False, port, str(pki.root), total, q, records))
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


def _relay_config(c: str, clusters: list[str], peer: dict[str, str], work: dict[str, str],
                  tmp: Path, pki: JobPKI) -> RelayConfig:
    """Cluster c's relay as the plan would make it (spec defaults), codec none."""
    pair, relay = pki.relay(c), RelaySpec()
    return RelayConfig(
        job_id="bench", cluster=c, clusters=clusters, peer_listen=peer[c],
        worker_listen=work[c], peers={o: peer[o] for o in clusters if o != c},
        tls={"ca": str(pki.ca_cert), "cert": str(pair.cert), "key": str(pair.key)},
        codec="none", error_feedback=False, feedback_decay={"none": FEEDBACK_DECAY},
        codec_params=CompressionSpec().params,
        round_timeout=120.0, heartbeat=relay.heartbeat, dead_after=relay.dead_after,
        shaping=ShapingConfig(rate_mbit=None, delay_ms=0.0), auto_steps=None,
        metrics_file=str(tmp / f"metrics-{c}.jsonl"), worker_socket=_socket(tmp, c))


def _socket(tmp: Path, c: str) -> str:
    return str(tmp / f"worker-{c}.sock")


def _rounds(clients: dict[str, RelayClient], xs: dict[str, torch.Tensor], first: int,
            repeat: int) -> list[dict[str, Any]]:
    """``repeat`` rounds on both clusters at once (after one to warm up): per round the wall
    time and each stage (the slower cluster's)."""
    out = []
    with ThreadPoolExecutor(len(clients)) as pool:
        for r in range(first, first + repeat + 1):
            t0 = time.perf_counter()
            futs = {c: pool.submit(clients[c].allreduce, r, xs[c]) for c in clients}
            res = {c: f.result(timeout=600) for c, f in futs.items()}
            wall = time.perf_counter() - t0
            if not torch.equal(res["a"].tensor, res["b"].tensor):
                raise RuntimeError("the two clusters got different averages")
            if r > first:  # the first connects, registers the size, warms the allocator
                stages = {k: max(x.stages[k] for x in res.values()) for k in STAGES}
                out.append({"wall": wall, **stages})
    return out


STAGES = ("send", "upload", "relay", "receive")


def relay_rounds(mb: int, repeat: int, tmp: Path, pki: JobPKI) -> dict[str, list[dict[str, Any]]]:
    """Two relay processes; ``repeat`` rounds of an ``mb`` MB fp32 model on both clusters, with
    workers on the relays' host (their Unix sockets), then with workers over TLS."""
    clusters = ["a", "b"]
    ports = free_ports(4)
    peer = {c: f"127.0.0.1:{ports[2 * i]}" for i, c in enumerate(clusters)}
    work = {c: f"127.0.0.1:{ports[2 * i + 1]}" for i, c in enumerate(clusters)}
    procs = []
    clients: list[RelayClient] = []
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "NEBULA_RELAY_LOG": os.environ.get("NEBULA_RELAY_LOG", "WARNING")}

    def client(c: str, local: str | None) -> RelayClient:
        w = pki.worker(c, "h0")
        clients.append(RelayClient(work[c], ca=pki.ca_cert, cert=w.cert, key=w.key,
                                   job_id="bench", cluster=c, round_timeout=120.0,
                                   retry_for=60.0, local=local))
        return clients[-1]

    try:
        for c in clusters:
            _relay_config(c, clusters, peer, work, tmp, pki).dump(tmp / f"relay-{c}.json")
            log = open(tmp / f"relay-{c}.log", "wb")  # noqa: SIM115 (closed with the process)
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "nebula_cli.relay.process.server", "--config",
                 str(tmp / f"relay-{c}.json")], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, cwd=REPO), log))
        numel = mb * (1 << 20) // 4
        xs = {c: torch.randn(numel) for c in clusters}
        local = {c: client(c, _socket(tmp, c)) for c in clusters}
        got = {"local": _rounds(local, xs, 0, repeat)}
        if {cl.transport for cl in local.values()} != {"local"}:
            raise RuntimeError("the workers did not use the relays' sockets")
        for cl in local.values():
            cl.close()
        tls = {c: client(c, None) for c in clusters}
        got["tls"] = _rounds(tls, xs, repeat + 1, repeat)
        return got
    finally:
        for cl in clients:
            cl.close()
        for p, log in procs:
            _relays.stop(p)
            log.close()


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values):6.3f}  {min(values):6.3f}-{max(values):.3f}"
            if values else "-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="model size in MB (fp32), >= 256 counts")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="64 MB, 2 repeats")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.repeat = 64, 2
    logging.getLogger("nebula").setLevel(logging.ERROR)  # "relay not up yet, retrying"
    total = args.mb << 20
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="nebula-bench-") as d:
        tmp = Path(d)
        pki = issue_job_pki("bench", {"a": ["h0"], "b": ["h0"]}, tmp / "pki",
                            valid_for=datetime.timedelta(days=1))
        rows: list[tuple[str, list[float], str]] = []
        raw = [stream(total, None)[0] for _ in range(args.repeat)]
        rows.append(("raw TCP, 1 stream", raw, "plain"))
        tls1 = [stream(total, pki) for _ in range(args.repeat)]
        rows.append(("TLS 1.3, 1 stream", [g for g, _ in tls1], tls1[0][1]))
        tls2 = [stream(total, pki, 2)[0] for _ in range(args.repeat)]
        rows.append(("TLS 1.3, 2 streams", tls2, ""))
        both = [duplex(total, pki) for _ in range(args.repeat)]
        rows.append(("TLS 1.3 duplex, 2 processes", both, "per direction, both at once"))
        recs = [duplex(total, pki, records=True) for _ in range(args.repeat)]
        rows.append(("records duplex, 2 processes", recs, "AES-GCM records, as the relays"))
        got = relay_rounds(args.mb, args.repeat, tmp, pki)
        rows.append(("relay WAN hop (both ways at once)",
                     [total / r["relay"] / 1e9 for r in got["local"]], "the relays' round"))
        rows.append(("relay end to end, worker on the relay's host",
                     [total / r["wall"] / 1e9 for r in got["local"]], "Unix socket, memfds"))
        rows.append(("relay end to end, worker on another host",
                     [total / r["wall"] / 1e9 for r in got["tls"]], "mutual TLS"))
    best_raw = max(raw)
    width = max(len(r[0]) for r in rows)
    print(f"{'path':<{width}}  {'GB/s':>6}  {'median':>6}  {'vs raw':>6}  note")
    for name, gbs, note in rows:
        print(f"{name:<{width}}  {max(gbs):6.2f}  {statistics.median(gbs):6.2f}  "
              f"{max(gbs) / best_raw:6.2f}  {note}")
    print(f"\nstages of a round, seconds (median  min-max over {args.repeat} rounds):")
    print(f"{'stage':<34}  {'worker on the relay host':<22}  worker over TLS")
    for key, what in (("send", "worker writes its contribution"),
                      ("upload", "relay reads it"),
                      ("relay", "relay's round (agree, exchange)"),
                      ("receive", "worker reads the average"), ("wall", "end to end")):
        print(f"{what:<34}  {_spread([r[key] for r in got['local']]):<22}  "
              f"{_spread([r[key] for r in got['tls']])}")
    load1 = os.getloadavg()[0]
    print(f"({args.mb} MB fp32, best of {args.repeat}; {os.cpu_count()} cores; load average "
          f"{load0:.2f} before, {load1:.2f} after; {ssl.OPENSSL_VERSION})")
    if args.json:
        ratio = {name: max(g) / best_raw for name, g, _ in rows}
        summary = {
            "end_to_end_vs_tcp": round(ratio["relay end to end, worker on the relay's host"], 3),
            "end_to_end_tls_vs_tcp": round(ratio["relay end to end, worker on another host"], 3),
            "tls_vs_tcp": round(ratio["TLS 1.3, 1 stream"], 3),
            "duplex_vs_tcp": round(ratio["TLS 1.3 duplex, 2 processes"], 3),
            "records_duplex_vs_tcp": round(ratio["records duplex, 2 processes"], 3),
            "wan_hop_vs_tcp": round(ratio["relay WAN hop (both ways at once)"], 3),
            "mb": args.mb, "repeat": args.repeat, "cores": os.cpu_count(),
            "load_average": [round(load0, 2), round(load1, 2)],
            "rows": {name: {"gb_s": round(max(g), 3), "median_gb_s": round(statistics.median(g), 3),
                            "ratio": round(max(g) / best_raw, 3), "note": note}
                     for name, g, note in rows},
            "stages": {way: {k: [round(r[k], 4) for r in got[way]] for k in (*STAGES, "wall")}
                       for way in got},
        }
        print(json.dumps(summary))
    return 0


JSON_FIELDS = ("end_to_end_vs_tcp", "tls_vs_tcp", "end_to_end_tls_vs_tcp", "wan_hop_vs_tcp",
               "duplex_vs_tcp", "records_duplex_vs_tcp", "stages")


if __name__ == "__main__":
    raise SystemExit(main())
