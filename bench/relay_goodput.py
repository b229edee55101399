"""Relay goodput and round time over shaped links: real relays (mutual TLS, then AES-GCM records)
on the test bed.

    .venv/bin/python bench/relay_goodput.py [--quick] [--json] [--mbit 20] [--mb 256] [--rounds 4]
                                            [--repeat 3]
    .venv/bin/python bench/relay_goodput.py --clusters 4 [--quick] [--json] [--mbit 20] [--mb 64]
                                            [--rounds 3] [--codecs none,int8,topk] [--gap 2]

Two clusters (the default): goodput against iperf3. One test bed (root): east = e1, west = w1,
the link between them shaped to --mbit by the bed's tc (no added delay). Everything runs inside
the two host namespaces, in this order:

  iperf3, one way           e1 -> w1, --iperf-s seconds (what TCP gets from the link)
  iperf3, both ways         the same with --bidir (the load pattern of an all-reduce)
  plain TCP, both ways      a small Python sender/receiver pair, --mb MiB each way at once
  TLS 1.3, both ways        the same through the job PKI's mutual-TLS contexts
  relay                     two real relay processes (nebula_cli.relay.process.server, codec none,
                            the job PKI) on e1 and w1, one RelayClient per side on the same host;
                            a warm-up round, then --rounds all-reduce rounds of an fp32 model,
                            --mb MiB each way in all, each round started as soon as both
                            clusters had the previous one

Goodput = model bytes delivered per direction / wall time, in Mbit/s: for the relay from the
start of the first timed round to the end of the last (each round is both clusters' allreduce:
local TLS hop, WAN exchange, the average back); every result is checked against the exact
average. Ratios: goodput_vs_iperf3 = relay / iperf3 both ways (per direction); tls_vs_plain =
relay (encrypted) / plain TCP of the same bytes on the same link (the relay has no plain mode).
--repeat N measures iperf3 both ways and the relay N times (one-way iperf3, plain TCP and TLS
once) and prints each run's goodput_vs_iperf3 beside its own iperf3; goodput_vs_iperf3 is then
the lowest of the runs (the goal holds for every run) and the spread (min, median, max) is
printed.

Three clusters or more (--clusters N): one outer round's time against its bandwidth bound.
Topology: one host per cluster (c1/g1, c2/g2, ...), each cluster behind ONE shaped line of
--mbit each way (the bed's link="cluster": a cluster's traffic to and from all other clusters
shares its uplink and its downlink, fairly between the peers), no added delay. A relay on each
host, a RelayClient beside it; for each codec of --codecs: a warm-up round, then --rounds timed
rounds of an fp32 vector of --mb MiB per cluster, all clusters starting a round at the same
instant, --gap seconds after every cluster had the previous one (the link idles as during
inner steps). Round time = from that instant to the moment the last cluster has the average
(its contribution's hop to the relay, the agreement, the WAN exchange, the average back).
TCP: the hosts run reno unless --tcp says otherwise (--tcp system: this machine's default, bbr
here). With no base delay on the bed BBR sizes its window from a min RTT of microseconds while
the lines' queues hold its ACKs behind the other direction's data for hundreds of ms, and a
connection crawls for seconds; shard mode then waits for it (tests/testbed/links.py). Users' hosts
run Linux's default cubic, which these namespaces do not allow; reno is loss-based like it (a
run with cubic set on the relays' sockets gave the same round times as reno). The same holds for
two clusters: with bbr the relay's goodput varied from 0.77 to 0.94 of iperf3 both ways across
runs of one hour (the relay's one duplex connection suffers more from it than iperf3's two),
with reno 0.99-1.01 (docs/benchmarks.md).
Algorithms (nebula_cli/relay/protocol/allreduce.py): dense codecs (none, int8) use "shard" (each
relay owns 1/N of the chunks: reduce-scatter then all-gather), each relay sending and receiving
about 2(N-1)/N of the encoded vector; sparse topk uses "all-to-all", each relay sending its whole
encoded contribution to every other (N-1 of them). Bound = the busiest relay's WAN bytes in the
round (the larger of sent and received, as the relays count them: encoded payload plus frame
headers) at the line's rate, so round_vs_bound = round time / bound cannot go below 1 (TLS,
TCP/IP and Ethernet headers cross the line too and are not in the bound). round_vs_bound in
the JSON is the worst of the shard-mode codecs run (over all timed rounds: total time / total
bound); round_vs_bound_all_to_all is topk's. Beside each codec, plain TCP between the same hosts
(bench/_mesh.py: one connection per pair, the relay's socket options, every pair exchanging the
busiest relay's bytes per peer both ways at once): tcp_vs_bound is what TCP itself makes of the
lines for those bytes, round_vs_tcp the relay's round against it. The workers reach their relay
through its Unix socket, as a job's worker on the gateway does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import selectors
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bed  # noqa: E402
import _clusters  # noqa: E402
import _mesh  # noqa: E402
import _relays  # noqa: E402

JSON_FIELDS = ("goodput_vs_iperf3", "tls_vs_plain", "link_mbit", "clusters")
"""Keys of the JSON object printed first with --json, two clusters (plus "goodput_vs_iperf3_runs",
"goodput_vs_iperf3_spread", "goals_met", "mbit", "settings")."""
JSON_FIELDS_N = _clusters.JSON_FIELDS
"""The same with --clusters 3 or more (bench/_clusters.py)."""
GOALS = {"goodput_vs_iperf3": (">=", 0.9)}
CLUSTERS = {"east": ["e1"], "west": ["w1"]}
STREAM_PORT, IPERF_PORT = 29500, 5201
PIECE = 1 << 20
QUICK = {"mb": 100, "rounds": 4, "iperf_s": 10}
QUICK_N = _clusters.QUICK


# ------------------------------------------------------------------ sides (in a namespace)

def _stream_side(args: argparse.Namespace) -> dict[str, Any]:
    """One end of a duplex transfer: send --bytes while receiving --bytes on one connection.

    One thread, non-blocking socket: OpenSSL does not allow SSL_read and SSL_write on one
    connection from two threads at once (seen here as SSLEOFError mid-transfer)."""
    from nebula_cli.pki import client_context, load_pki, server_context
    from nebula_cli.relay.process.client import tune_socket

    host, port = args.addr.rsplit(":", 1)
    if args.side == "server":
        with socket.create_server((host, int(port))) as ls:
            ls.settimeout(60)
            sock, _ = ls.accept()
    else:
        sock = socket.create_connection((host, int(port)), timeout=30)
    tune_socket(sock)
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


# ------------------------------------------------------------------ driver (root namespace)

def _sides(bed: Any, tmp: Path, name: str, argvs: dict[str, list[str]],
           timeout: float) -> dict[str, dict[str, Any]]:
    """Run `--side ...` of this script on each host (host -> argv) at once; their JSON results."""
    procs = {}
    for host, argv in argvs.items():
        with open(tmp / f"{name}-{host}.err", "w") as err:
            procs[host] = bed.popen(host, [sys.executable, "-u", __file__, *argv],
                                    stdout=subprocess.PIPE, stderr=err, text=True,
                                    cwd=_bed.REPO, env=_relays.env())
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
    per_round = nbytes // rounds // 4 * 4
    link = bed.rate("east", "west") or 1e3
    run = _relays.run_rounds(bed, tmp, pki_dir, {"east": "e1", "west": "w1"}, codec="none",
                             nbytes=per_round, rounds=rounds, gap=0.0,
                             round_timeout=300 + per_round * 8 / 1e6 / link * 3)
    seconds = (max(d["end"] for d in run["rounds"][-1]["done"].values())
               - run["rounds"][0]["start"])
    sent = [d["bytes_sent"] for r in run["rounds"] for d in r["done"].values()]
    return {"mbit": per_round * rounds * 8 / 1e6 / seconds, "seconds": seconds,
            "bytes": per_round * rounds, "wan_bytes_sent": sum(sent) // 2}


# ------------------------------------------------------------------ main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--clusters", type=int, default=2,
                   help="2: goodput vs iperf3; 3 or more: round time vs its bound")
    p.add_argument("--mbit", type=float, default=20.0, help="link (line) rate, Mbit/s")
    p.add_argument("--mb", type=int, default=None,
                   help="MiB of fp32 model: each way by each transfer (2 clusters, default "
                        "256), per cluster per round (3+, default 64)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed relay rounds (default 4; 3+ clusters: 3)")
    p.add_argument("--iperf-s", type=int, default=None, help="iperf3 seconds (default 10)")
    p.add_argument("--repeat", type=int, default=1,
                   help="2 clusters: measure iperf3 both ways and the relay this many times")
    p.add_argument("--codecs", default="none,int8,topk", help="3+ clusters: codecs to run")
    p.add_argument("--gap", type=float, default=2.0,
                   help="3+ clusters: idle seconds between rounds")
    p.add_argument("--train-steps", type=int, default=20,
                   help="3+ clusters: steps of the training job at the end (0: none)")
    p.add_argument("--train-h", type=int, default=10,
                   help="3+ clusters: inner steps between the training job's rounds")
    p.add_argument("--tcp", default=None,
                   help="the bed hosts' TCP congestion control, or 'system' for this machine's "
                        "(default: reno, see above)")
    p.add_argument("--quick", action="store_true",
                   help=f"CI-sized: 2 clusters {QUICK['mb']} MiB in {QUICK['rounds']} rounds, "
                        f"iperf3 {QUICK['iperf_s']} s (about 3 minutes at 20 Mbit/s per "
                        f"repeat); 3+ clusters {QUICK_N['mb']} MiB, {QUICK_N['rounds']} rounds")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    # the sides, run by the driver inside a host's namespace
    p.add_argument("--side", choices=["server", "client", "relay", "mesh"],
                   help=argparse.SUPPRESS)
    for name in ("--addr", "--pki", "--cluster", "--host", "--codec", "--clusters-list",
                 "--tmp", "--index", "--addrs"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tls", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    many = args.clusters >= 3
    quick = QUICK_N if many else QUICK
    args.mb = args.mb or (quick["mb"] if args.quick else 64 if many else 256)
    args.rounds = args.rounds or (quick["rounds"] if args.quick else 3 if many else 4)
    args.iperf_s = args.iperf_s or (QUICK["iperf_s"] if args.quick else 10)
    args.codec_list = [c for c in args.codecs.split(",") if c]
    args.tcp = args.tcp or _clusters.TCP
    args.tcp_label = args.tcp if args.tcp != "system" else f"system ({_clusters.system_tcp()})"
    args.tcp = None if args.tcp == "system" else args.tcp
    from nebula_cli.relay.codecs.registry import KNOWN_CODECS

    if args.mb < 1 or args.rounds < 1 or args.iperf_s < 1 or args.mbit <= 0 or args.repeat < 1:
        p.error("--mb, --rounds, --iperf-s, --repeat >= 1 and --mbit > 0")
    if not 2 <= args.clusters <= 8:
        p.error("--clusters: 2 to 8")
    if not args.codec_list or set(args.codec_list) - set(KNOWN_CODECS):
        p.error(f"--codecs: a comma-separated list of {', '.join(KNOWN_CODECS)}")
    return args


def summarize(mbit: dict[str, float], link_mbit: float, runs: list[dict[str, float]]
              ) -> dict[str, Any]:
    """The JSON object (JSON_FIELDS first) from the measured Mbit/s per direction: `mbit` holds
    the one-off paths, `runs` each repetition's iperf3 both ways and relay."""
    def r(a: float | None, b: float | None) -> float | None:
        v = _bed.ratio(a, b)
        return None if v is None else round(v, 4)

    each = [r(x["relay"], x["iperf3_bidir"]) for x in runs]
    ok = [v for v in each if v is not None]
    first = runs[0]
    out: dict[str, Any] = {
        "goodput_vs_iperf3": min(ok) if ok else None,
        "tls_vs_plain": r(first.get("relay"), mbit.get("plain")),
        "link_mbit": link_mbit,
        "clusters": 2,
        "goodput_vs_iperf3_runs": each,
        "goodput_vs_iperf3_spread": {"min": min(ok), "median": statistics.median(ok),
                                     "max": max(ok)} if ok else None,
        "goodput_vs_iperf3_one_way": r(first.get("relay"), mbit.get("iperf3")),
        "tls_stream_vs_plain": r(mbit.get("tls"), mbit.get("plain")),
    }
    out["goals_met"] = {k: out[k] is not None and out[k] >= v for k, (_, v) in GOALS.items()}
    out["mbit"] = {k: round(v, 3) for k, v in mbit.items()}
    out["mbit_runs"] = [{k: round(v, 3) for k, v in x.items()} for x in runs]
    return out


def measure_two(args: argparse.Namespace) -> tuple[dict[str, float], list[dict[str, float]],
                                                    dict[str, str]]:
    """Two clusters: the one-off paths (Mbit/s), each repetition's iperf3 both ways and relay."""
    from nebula_cli.pki import issue_job_pki

    nbytes = args.mb << 20
    tmp = Path(tempfile.mkdtemp(prefix="nebula-bench-goodput-"))
    mbit: dict[str, float] = {}
    runs: list[dict[str, float]] = []
    notes: dict[str, str] = {}
    try:
        pki = tmp / "pki"
        issue_job_pki(_relays.JOB, CLUSTERS, pki, valid_for=datetime.timedelta(days=1))
        with _bed.make_bed(CLUSTERS, args.mbit, tcp=args.tcp) as bed:
            _bed.say("iperf3 one way ...")
            mbit["iperf3"], _ = iperf3(bed, args.iperf_s, bidir=False)
            _bed.say(f"plain TCP, {args.mb} MiB each way ...")
            mbit["plain"] = stream(bed, tmp, nbytes, False, pki)
            _bed.say(f"TLS 1.3, {args.mb} MiB each way ...")
            mbit["tls"] = stream(bed, tmp, nbytes, True, pki)
            for i in range(args.repeat):
                run = {}
                _bed.say(f"run {i + 1}/{args.repeat}: iperf3 both ways ...")
                fwd, back = iperf3(bed, args.iperf_s, bidir=True)
                run["iperf3_bidir"] = (fwd + back) / 2
                notes.setdefault("iperf3_bidir", f"e1->w1 {fwd:.2f}, w1->e1 {back:.2f}")
                _bed.say(f"run {i + 1}/{args.repeat}: relay, {args.mb} MiB each way in "
                         f"{args.rounds} rounds ...")
                rel = relay(bed, tmp, nbytes, args.rounds, pki)
                run["relay"] = rel["mbit"]
                notes.setdefault("relay", f"{rel['bytes'] / 1e6:.0f} MB model each way in "
                                          f"{rel['seconds']:.1f} s; "
                                          f"{rel['wan_bytes_sent'] / 1e6:.1f} MB sent per relay")
                _bed.say(f"run {i + 1}: relay / iperf3 both ways = "
                         f"{run['relay'] / run['iperf3_bidir']:.3f} ...")
                runs.append(run)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return mbit, runs, notes


def print_two(summary: dict[str, Any], mbit: dict[str, float], runs: list[dict[str, float]],
              notes: dict[str, str], args: argparse.Namespace) -> None:
    labels = {"iperf3": "iperf3, one way", "iperf3_bidir": "iperf3, both ways at once",
              "plain": "plain TCP (python), both ways", "tls": "TLS 1.3 (python), both ways",
              "relay": "relay allreduce (records, codec none)"}
    paths = {"iperf3": mbit["iperf3"], "iperf3_bidir": runs[0]["iperf3_bidir"],
             "plain": mbit["plain"], "tls": mbit["tls"], "relay": runs[0]["relay"]}
    rows = [[labels[k], v, _bed.ratio(v, paths["iperf3_bidir"]), _bed.ratio(v, paths["plain"]),
             notes.get(k, "")] for k, v in paths.items()]
    print(_bed.table(["path (first run)", "Mbit/s each way", "vs iperf3 both", "vs plain",
                      "note"], rows))
    if len(runs) > 1:
        print()
        print(_bed.table(["run", "iperf3 both ways", "relay", "goodput_vs_iperf3"],
                         [[i + 1, x["iperf3_bidir"], x["relay"], v] for i, (x, v) in
                          enumerate(zip(runs, summary["goodput_vs_iperf3_runs"], strict=True))]))
        sp = summary["goodput_vs_iperf3_spread"]
        print(f"spread: min {sp['min']}, median {sp['median']}, max {sp['max']}")
    print()
    goal = summary["goals_met"]["goodput_vs_iperf3"]
    print(_bed.table(["ratio", "value", "goal", ""], [
        ["goodput_vs_iperf3" + (" (lowest run)" if len(runs) > 1 else ""),
         summary["goodput_vs_iperf3"], ">= 0.9", "met" if goal else "NOT met"],
        ["tls_vs_plain", summary["tls_vs_plain"], "", ""]]))
    print(f"\nlink {args.mbit:g} Mbit/s each way (tc htb, no added delay), hosts' TCP "
          f"{args.tcp_label}; {args.mb} MiB of "
          f"fp32 each way per transfer; Mbit/s of payload (iperf3: TCP payload; relay: model "
          f"bytes, frame headers and TLS not counted). {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side in ("server", "client"):
        print(json.dumps(_stream_side(args)))
        return 0
    if args.side == "relay":
        _relays.client_side(args)
        return 0
    if args.side == "mesh":
        print(json.dumps(_mesh.side(args)))
        return 0
    _bed.require_bed()
    if args.clusters >= 3:
        summary = _clusters.summarize(_clusters.measure(args), args)
        _clusters.show(summary, args)
    else:
        mbit, runs, notes = measure_two(args)
        summary = summarize(mbit, args.mbit, runs)
        summary["settings"] = {"mb": args.mb, "rounds": args.rounds, "iperf_s": args.iperf_s,
                               "repeat": args.repeat, "quick": args.quick,
                               "tcp": args.tcp_label}
        print_two(summary, mbit, runs, notes, args)
    if args.json:
        _bed.emit_json(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
