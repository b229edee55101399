"""Relay goodput over a shaped link: two relays (mutual TLS) against iperf3 and plain TCP.

    .venv/bin/python bench/relay_goodput.py [--quick] [--json] [--mbit 20] [--mb 256] [--rounds 4]

One test bed (root): east = e1, west = w1, the link between them shaped to --mbit by the bed's
tc (no added delay). Everything runs inside the two host namespaces, in this order:

  iperf3, one way           e1 -> w1, --iperf-s seconds (what TCP gets from the link)
  iperf3, both ways         the same with --bidir (the load pattern of an all-reduce)
  plain TCP, both ways      a small Python sender/receiver pair, --mb MiB each way at once
  TLS 1.3, both ways        the same through the job PKI's mutual-TLS contexts
  relay                     two real relay processes (nebula_cli.relay.server, codec none, the
                            job PKI) on e1 and w1, one RelayClient per side on the same host;
                            --rounds all-reduce rounds of an fp32 model, --mb MiB each way in all

Goodput = model bytes delivered per direction / wall time, in Mbit/s: for the relay the time
from after a small warm-up round to the end of the last round, the slower side's (each round is
both clusters' allreduce: local TLS hop, WAN exchange, the average back); every result is checked
against the exact average. Ratios: goodput_vs_iperf3 = relay / iperf3 both ways (per
direction); tls_vs_plain = relay (TLS on) / plain TCP of the same bytes on the same link (the
relay has no plain mode).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import selectors
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bed  # noqa: E402

JSON_FIELDS = ("goodput_vs_iperf3", "tls_vs_plain", "link_mbit")
"""Keys of the JSON object printed last with --json (plus "goals_met", "mbit", "settings")."""
GOALS = {"goodput_vs_iperf3": (">=", 0.9)}
CLUSTERS = {"east": ["e1"], "west": ["w1"]}
JOB = "bench-goodput"
PEER_PORT, WORKER_PORT, STREAM_PORT, IPERF_PORT = 29400, 29401, 29500, 5201
PIECE = 1 << 20
QUICK = {"mb": 100, "rounds": 4, "iperf_s": 10}


# ------------------------------------------------------------------ sides (in a namespace)

def _stream_side(args: argparse.Namespace) -> dict[str, Any]:
    """One end of a duplex transfer: send --bytes while receiving --bytes on one connection.

    One thread, non-blocking socket: OpenSSL does not allow SSL_read and SSL_write on one
    connection from two threads at once (seen here as SSLEOFError mid-transfer)."""
    from nebula_cli.pki import client_context, load_pki, server_context
    from nebula_cli.relay.client import tune_buffers

    host, port = args.addr.rsplit(":", 1)
    if args.side == "server":
        with socket.create_server((host, int(port))) as ls:
            ls.settimeout(60)
            sock, _ = ls.accept()
    else:
        sock = socket.create_connection((host, int(port)), timeout=30)
    tune_buffers(sock)
    sock.settimeout(30)
    if args.tls:
        pki = load_pki(Path(args.pki))
        if args.side == "server":
            sock = server_context(pki.relay("west"), pki.ca_cert).wrap_socket(
                sock, server_side=True)
        else:
            sock = client_context(pki.relay("east"), pki.ca_cert).wrap_socket(sock)
    sock.setblocking(False)
    total, sent, got = args.bytes, 0, 0
    data, buf = memoryview(bytearray(PIECE)), memoryview(bytearray(PIECE))
    retry = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
    t0 = time.perf_counter()
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        while sent < total or got < total:
            progress = False
            if got < total:
                try:
                    while got < total:  # drain, including what TLS has decrypted already
                        k = sock.recv_into(buf)
                        if not k:
                            raise SystemExit(f"connection closed after {got} of {total} bytes")
                        got += k
                        progress = True
                except retry:
                    pass
            if sent < total:
                try:  # a retry passes the same bytes again, as OpenSSL requires
                    sent += sock.send(data[: min(PIECE, total - sent)])
                    progress = True
                except retry:
                    pass
            if not progress and not sel.select(60):
                raise SystemExit(f"stalled: sent {sent}, received {got} of {total} bytes")
    seconds = time.perf_counter() - t0
    sock.close()
    return {"seconds": seconds, "received": got, "tls": args.tls}


def _relay_side(args: argparse.Namespace) -> dict[str, Any]:
    """This cluster's RelayClient: a warm-up round, then --rounds timed rounds, each checked."""
    import torch

    from nebula_cli.relay.client import RelayClient

    numel = args.bytes // 4
    seeds = {"east": 1, "west": 2}
    xs = {}
    for cluster, seed in seeds.items():
        torch.manual_seed(seed)
        xs[cluster] = torch.randn(numel)
    expected = (xs["east"] + xs["west"]) / 2
    mine = xs[args.cluster]
    pki = Path(args.pki)
    client = RelayClient(args.addr, ca=pki / "ca.pem",
                         cert=pki / args.cluster / f"worker-{args.host}.pem",
                         key=pki / args.cluster / f"worker-{args.host}.key", job_id=JOB,
                         cluster=args.cluster, round_timeout=600.0, retry_for=60.0)
    try:
        client.allreduce(0, torch.ones(4))
        times, sent = [], []
        t0 = time.perf_counter()
        for r in range(1, args.rounds + 1):
            t = time.perf_counter()
            res = client.allreduce(r, mine)
            times.append(time.perf_counter() - t)
            sent.append(res.bytes_sent)
            if res.present != ["east", "west"] or not torch.allclose(res.tensor, expected,
                                                                      rtol=0, atol=1e-6):
                raise SystemExit(f"round {r}: wrong average (present {res.present})")
        seconds = time.perf_counter() - t0
        digest = hashlib.sha256(res.tensor.numpy().tobytes()).hexdigest()
    finally:
        client.close()
    return {"seconds": seconds, "round_s": times, "bytes_sent": sent, "sha256": digest}


# ------------------------------------------------------------------ driver (root namespace)

def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(_bed.REPO), "NEBULA_RELAY_LOG": "WARNING",
            "OMP_NUM_THREADS": "1"}


def _sides(bed: Any, tmp: Path, name: str, argvs: dict[str, list[str]],
           timeout: float) -> dict[str, dict[str, Any]]:
    """Run `--side ...` of this script on each host (host -> argv) at once; their JSON results."""
    procs = {}
    for host, argv in argvs.items():
        with open(tmp / f"{name}-{host}.err", "w") as err:
            procs[host] = bed.popen(host, [sys.executable, "-u", __file__, *argv],
                                    stdout=subprocess.PIPE, stderr=err, text=True,
                                    cwd=_bed.REPO, env=_env())
        if argv[1] == "server":  # the server must listen before the client dials
            try:
                bed.wait_listening(host, STREAM_PORT, timeout=60)
            except Exception as exc:
                err = (tmp / f"{name}-{host}.err").read_text()[-2000:]
                raise RuntimeError(f"{name} on {host} did not start: {err}") from exc
    out = {}
    try:
        for host, proc in procs.items():
            stdout, _ = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                err = (tmp / f"{name}-{host}.err").read_text()[-2000:]
                raise RuntimeError(f"{name} on {host} exited {proc.returncode}: {err}")
            out[host] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return out


def iperf3(bed: Any, seconds: int, bidir: bool) -> tuple[float, float]:
    """Mbit/s received (e1 -> w1, w1 -> e1; the second is 0 unless bidir) by iperf3."""
    w1 = bed.hosts["w1"].address
    srv = bed.popen("w1", ["iperf3", "-s", "-1", "-B", w1, "-p", str(IPERF_PORT)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        bed.wait_listening("w1", IPERF_PORT)
        out = bed.run("e1", ["iperf3", "-c", w1, "-p", str(IPERF_PORT), "-t", str(seconds), "-J",
                             *(["--bidir"] if bidir else [])], timeout=seconds + 60,
                      check=True).stdout
        srv.wait(timeout=30)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    end = json.loads(out)["end"]
    back = end.get("sum_received_bidir_reverse", {}).get("bits_per_second", 0.0)
    return end["sum_received"]["bits_per_second"] / 1e6, back / 1e6


def stream(bed: Any, tmp: Path, nbytes: int, tls: bool, pki: Path) -> float:
    """Mbit/s per direction of a duplex transfer of nbytes each way, e1 <-> w1."""
    addr = f"{bed.hosts['w1'].address}:{STREAM_PORT}"
    common = ["--addr", addr, "--bytes", str(nbytes), "--pki", str(pki),
              *(["--tls"] if tls else [])]
    res = _sides(bed, tmp, "tls" if tls else "plain",
                 {"w1": ["--side", "server", *common], "e1": ["--side", "client", *common]},
                 timeout=120 + nbytes * 8 / 1e6 / max(bed.rate("east", "west") or 1e3, 1) * 3)
    if any(r["received"] != nbytes for r in res.values()):
        raise RuntimeError(f"stream: received {[r['received'] for r in res.values()]} "
                           f"of {nbytes} bytes")
    return nbytes * 8 / 1e6 / max(r["seconds"] for r in res.values())


def relay(bed: Any, tmp: Path, nbytes: int, rounds: int, pki_dir: Path) -> dict[str, Any]:
    """Two relays (e1, w1) and a RelayClient beside each: Mbit/s of model per direction."""
    from nebula_cli.config.spec import CompressionSpec
    from nebula_cli.relay.config import RelayConfig, ShapingConfig

    gateway = {"east": "e1", "west": "w1"}
    peer = {c: f"{bed.hosts[h].address}:{PEER_PORT}" for c, h in gateway.items()}
    relays = []
    try:
        for cluster, host in gateway.items():
            cfg = RelayConfig(
                job_id=JOB, cluster=cluster, clusters=list(gateway),
                peer_listen=peer[cluster], worker_listen=f"127.0.0.1:{WORKER_PORT}",
                peers={c: a for c, a in peer.items() if c != cluster},
                tls={"ca": str(pki_dir / "ca.pem"),
                     "cert": str(pki_dir / cluster / "relay.pem"),
                     "key": str(pki_dir / cluster / "relay.key")},
                codec="none", error_feedback=False, block_size=CompressionSpec().block_size,
                round_timeout=600.0,
                heartbeat=5.0, shaping=ShapingConfig(rate_mbit=None, delay_ms=0.0), auto_steps=None,
                status_file=str(tmp / f"relay-{cluster}.status.json"),
                metrics_file=str(tmp / f"relay-{cluster}.jsonl"))
            cfg.dump(tmp / f"relay-{cluster}.json")
            with open(tmp / f"relay-{cluster}.log", "w") as log:
                relays.append(bed.popen(host, [sys.executable, "-m", "nebula_cli.relay.server",
                                               "--config", str(tmp / f"relay-{cluster}.json")],
                                        stdout=log, stderr=subprocess.STDOUT, cwd=_bed.REPO,
                                        env=_env()))
        for host in gateway.values():
            bed.wait_listening(host, WORKER_PORT, timeout=60)
        per_round = nbytes // rounds // 4 * 4
        argvs = {host: ["--side", "relay", "--addr", f"127.0.0.1:{WORKER_PORT}",
                        "--cluster", cluster, "--host", host, "--pki", str(pki_dir),
                        "--bytes", str(per_round), "--rounds", str(rounds)]
                 for cluster, host in gateway.items()}
        link = bed.rate("east", "west") or 1e3
        res = _sides(bed, tmp, "relay", argvs, timeout=300 + nbytes * 8 / 1e6 / link * 3)
    finally:
        for proc in relays:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
    if len({r["sha256"] for r in res.values()}) != 1:
        raise RuntimeError("the two clusters got different averages")
    seconds = max(r["seconds"] for r in res.values())
    return {"mbit": per_round * rounds * 8 / 1e6 / seconds, "seconds": seconds,
            "bytes": per_round * rounds,
            "wan_bytes_sent": sum(sum(r["bytes_sent"]) for r in res.values()) // 2}


# ------------------------------------------------------------------ main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--mbit", type=float, default=20.0, help="e1-w1 link rate (Mbit/s)")
    p.add_argument("--mb", type=int, default=None,
                   help="MiB of fp32 model moved each way by each transfer (default 256)")
    p.add_argument("--rounds", type=int, default=None, help="relay rounds (default 4)")
    p.add_argument("--iperf-s", type=int, default=None, help="iperf3 seconds (default 10)")
    p.add_argument("--quick", action="store_true",
                   help=f"CI-sized: {QUICK['mb']} MiB in {QUICK['rounds']} rounds, iperf3 "
                        f"{QUICK['iperf_s']} s (about 3 minutes at 20 Mbit/s)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    # the sides, run by the driver inside a host's namespace
    p.add_argument("--side", choices=["server", "client", "relay"], help=argparse.SUPPRESS)
    for name in ("--addr", "--pki", "--cluster", "--host"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tls", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mb = args.mb or (QUICK["mb"] if args.quick else 256)
    args.rounds = args.rounds or (QUICK["rounds"] if args.quick else 4)
    args.iperf_s = args.iperf_s or (QUICK["iperf_s"] if args.quick else 10)
    if args.mb < 1 or args.rounds < 1 or args.iperf_s < 1 or args.mbit <= 0:
        p.error("--mb, --rounds, --iperf-s >= 1 and --mbit > 0")
    return args


def summarize(mbit: dict[str, float], link_mbit: float) -> dict[str, Any]:
    """The JSON object (JSON_FIELDS first) from the measured Mbit/s per direction."""
    def r(a: float | None, b: float | None) -> float | None:
        v = _bed.ratio(a, b)
        return None if v is None else round(v, 4)

    out: dict[str, Any] = {
        "goodput_vs_iperf3": r(mbit.get("relay"), mbit.get("iperf3_bidir")),
        "tls_vs_plain": r(mbit.get("relay"), mbit.get("plain")),
        "link_mbit": link_mbit,
        "goodput_vs_iperf3_one_way": r(mbit.get("relay"), mbit.get("iperf3")),
        "tls_stream_vs_plain": r(mbit.get("tls"), mbit.get("plain")),
    }
    out["goals_met"] = {k: out[k] is not None and out[k] >= v for k, (_, v) in GOALS.items()}
    out["mbit"] = {k: round(v, 3) for k, v in mbit.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side in ("server", "client"):
        print(json.dumps(_stream_side(args)))
        return 0
    if args.side == "relay":
        print(json.dumps(_relay_side(args)))
        return 0
    _bed.require_bed()
    from nebula_cli.pki import issue_job_pki

    nbytes = args.mb << 20
    tmp = Path(tempfile.mkdtemp(prefix="nebula-bench-goodput-"))
    mbit: dict[str, float] = {}
    notes: dict[str, str] = {}

    def step(name: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)

    try:
        pki = tmp / "pki"
        issue_job_pki(JOB, CLUSTERS, pki, valid_for=datetime.timedelta(days=1))
        with _bed.make_bed(CLUSTERS, args.mbit) as bed:
            step("iperf3 one way")
            mbit["iperf3"], _ = iperf3(bed, args.iperf_s, bidir=False)
            step("iperf3 both ways")
            fwd, back = iperf3(bed, args.iperf_s, bidir=True)
            mbit["iperf3_bidir"] = (fwd + back) / 2
            notes["iperf3_bidir"] = f"e1->w1 {fwd:.2f}, w1->e1 {back:.2f}"
            step(f"plain TCP, {args.mb} MiB each way")
            mbit["plain"] = stream(bed, tmp, nbytes, False, pki)
            step(f"TLS 1.3, {args.mb} MiB each way")
            mbit["tls"] = stream(bed, tmp, nbytes, True, pki)
            step(f"relay, {args.mb} MiB each way in {args.rounds} rounds")
            rel = relay(bed, tmp, nbytes, args.rounds, pki)
            mbit["relay"] = rel["mbit"]
            notes["relay"] = (f"{rel['bytes'] / 1e6:.0f} MB model each way in "
                              f"{rel['seconds']:.1f} s; {rel['wan_bytes_sent'] / 1e6:.1f} MB "
                              f"sent per relay")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = summarize(mbit, args.mbit)
    summary["settings"] = {"mb": args.mb, "rounds": args.rounds, "iperf_s": args.iperf_s,
                           "quick": args.quick}
    labels = {"iperf3": "iperf3, one way", "iperf3_bidir": "iperf3, both ways at once",
              "plain": "plain TCP (python), both ways", "tls": "TLS 1.3 (python), both ways",
              "relay": "relay allreduce (TLS, codec none)"}
    rows = [[labels[k], v, _bed.ratio(v, mbit["iperf3_bidir"]), _bed.ratio(v, mbit["plain"]),
             notes.get(k, "")] for k, v in mbit.items()]
    print(_bed.table(["path", "Mbit/s each way", "vs iperf3 both", "vs plain", "note"], rows))
    print()
    goal = summary["goals_met"]["goodput_vs_iperf3"]
    print(_bed.table(["ratio", "value", "goal", ""], [
        ["goodput_vs_iperf3", summary["goodput_vs_iperf3"], ">= 0.9",
         "met" if goal else "NOT met"],
        ["tls_vs_plain", summary["tls_vs_plain"], "", ""]]))
    print(f"\nlink {args.mbit:g} Mbit/s each way (tc htb, no added delay); {args.mb} MiB of "
          f"fp32 each way per transfer; Mbit/s of payload (iperf3: TCP payload; relay: model "
          f"bytes, frame headers and TLS not counted). {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}.")
    if args.json:
        _bed.emit_json(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
