"""Relays on the test bed for bench/relay_goodput.py: one real relay process per cluster, and
beside each a worker side (a RelayClient in that host's namespace, on the relay's Unix socket
as a job's worker on the gateway is) that runs rounds in step with the other clusters.

- `relays(bed, tmp, pki, gateway, codec)`: a context manager; a relay
  (nebula_cli.relay.process.server, the job PKI, the spec's defaults for everything the bench does
  not set) on each gateway host; `stop(proc)` ends a relay process.
- `client_side(args)`: runs inside a host's namespace (`relay_goodput.py --side relay ...`). It
  says READY (with its contribution's encoded size), then for every `GO <round> <start>` line on
  stdin waits until `start` (wall clock, shared by every namespace of this machine), runs that
  round and answers DONE with the round's start, end, the relay's WAN bytes and the result's
  digest; `END` closes it. Every result is checked: codec none against the exact average of
  every cluster's contribution, lossy codecs by their relative error (reported).
- `run_rounds(...)`: the driver: starts the sides, round 0 as a warm-up (connections, TCP
  windows), then the timed rounds, each started at the same instant everywhere `gap` seconds
  after the previous one ended on every cluster (the idle link of a training's inner steps).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _bed

JOB = "bench-goodput"
PEER_PORT, WORKER_PORT = 29400, 29401
SEEDS_FROM = 1
"""Cluster i (in the job's order) contributes randn with seed SEEDS_FROM + i."""


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(_bed.REPO), "NEBULA_RELAY_LOG": "WARNING",
            "OMP_NUM_THREADS": "1"}


def socket_path(tmp: Path, cluster: str) -> Path:
    """The relay's Unix socket for workers on its host (what a job's plan gives a gateway)."""
    return tmp / f"relay-{cluster}.sock"


@contextlib.contextmanager
def relays(bed: Any, tmp: Path, pki_dir: Path, gateway: dict[str, str], codec: str
           ) -> Iterator[None]:
    """A relay per cluster (cluster -> gateway host), codec `codec`, the spec's defaults
    (error feedback, block size, topk's density and bits, heartbeat, dead_after) otherwise."""
    from nebula_cli.config.relay_config import RelayConfig, ShapingConfig
    from nebula_cli.config.sections import CompressionSpec, RelaySpec

    spec = RelaySpec(compression=CompressionSpec(codec=codec))
    comp = spec.compression
    peer = {c: f"{bed.hosts[h].address}:{PEER_PORT}" for c, h in gateway.items()}
    procs = []
    try:
        for cluster, host in gateway.items():
            cfg = RelayConfig(
                job_id=JOB, cluster=cluster, clusters=list(gateway),
                peer_listen=peer[cluster], worker_listen=f"127.0.0.1:{WORKER_PORT}",
                peers={c: a for c, a in peer.items() if c != cluster},
                tls={"ca": str(pki_dir / "ca.pem"),
                     "cert": str(pki_dir / cluster / "relay.pem"),
                     "key": str(pki_dir / cluster / "relay.key")},
                codec=codec, error_feedback=comp.error_feedback,
                feedback_decay=comp.decays,
                codec_params=comp.params,
                round_timeout=900.0,
                heartbeat=spec.heartbeat, dead_after=spec.dead_after,
                shaping=ShapingConfig(rate_mbit=None, delay_ms=0.0), auto_steps=None,
                worker_socket=str(socket_path(tmp, cluster)),
                status_file=str(tmp / f"relay-{cluster}.status.json"),
                metrics_file=str(tmp / f"relay-{cluster}-{codec}.jsonl"))
            cfg.dump(tmp / f"relay-{cluster}.json")
            with open(tmp / f"relay-{cluster}-{codec}.log", "w") as log:
                procs.append(bed.popen(host, [sys.executable, "-m",
                                              "nebula_cli.relay.process.server", "--config",
                                       str(tmp / f"relay-{cluster}.json")], stdout=log,
                                       stderr=subprocess.STDOUT, cwd=_bed.REPO, env=env()))
        for host in gateway.values():
            bed.wait_listening(host, WORKER_PORT, timeout=60)
        yield
    finally:
        for proc in procs:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """End a relay process: SIGTERM, up to 15 s for its clean stop, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ------------------------------------------------------------------ the side (in a namespace)

def _say(kind: str, obj: dict[str, Any]) -> None:
    print(f"{kind} {json.dumps(obj)}", flush=True)


def client_side(args: argparse.Namespace) -> None:
    """This cluster's RelayClient, driven by GO/END lines on stdin (module docstring)."""
    import torch

    from nebula_cli.config.sections import CompressionSpec
    from nebula_cli.relay.codecs.chunks import iter_chunks
    from nebula_cli.relay.codecs.registry import get_codec
    from nebula_cli.relay.process.client import RelayClient

    clusters = args.clusters_list.split(",")
    numel = args.bytes // 4
    xs = {}
    for i, cluster in enumerate(clusters):
        torch.manual_seed(SEEDS_FROM + i)
        xs[cluster] = torch.randn(numel)
    names = sorted(clusters)  # the relays' order of summation (allreduce.ordered_mean)
    expected = xs[names[0]].clone()
    for name in names[1:]:
        expected.add_(xs[name])
    expected.div_(len(names))
    mine = xs[args.cluster]
    comp = CompressionSpec(codec=args.codec)
    codec = get_codec(args.codec, block_size=comp.block_size, density=comp.density,
                      bits=comp.bits)
    encoded = numel * 4 if args.codec == "none" else sum(
        codec.encode(c).nbytes for c in iter_chunks(mine, 1 << 20, align=comp.block_size))
    pki = Path(args.pki)
    client = RelayClient(args.addr, ca=pki / "ca.pem",
                         cert=pki / args.cluster / f"worker-{args.host}.pem",
                         key=pki / args.cluster / f"worker-{args.host}.key", job_id=JOB,
                         cluster=args.cluster, round_timeout=900.0, retry_for=60.0,
                         local=str(socket_path(Path(args.tmp), args.cluster)))
    _say("READY", {"encoded_bytes": encoded, "numel": numel})
    try:
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "END":
                break
            r, start = int(words[1]), float(words[2])
            time.sleep(max(0.0, start - time.time()))
            t0 = time.time()
            res = client.allreduce(r, mine)
            t1 = time.time()
            avg = res.tensor
            err = float((avg - expected).norm() / expected.norm())
            if sorted(res.present) != names or not math.isfinite(err):
                raise SystemExit(f"round {r}: present {res.present}, relative error {err}")
            if args.codec == "none" and not torch.allclose(avg, expected, rtol=0, atol=1e-6):
                raise SystemExit(f"round {r}: not the exact average (relative error {err:.3g})")
            _say("DONE", {"round": r, "start": t0, "end": t1, "bytes_sent": res.bytes_sent,
                          "bytes_received": res.bytes_received, "relay_s": res.seconds,
                          "error": err, "transport": client.transport,
                          "stages": res.stages,
                          "sha256": hashlib.sha256(avg.numpy().tobytes()).hexdigest()})
    finally:
        client.close()


# ------------------------------------------------------------------ the driver

class _Side:
    """One side's process and a thread that queues its stdout lines."""

    def __init__(self, proc: subprocess.Popen, err: Path) -> None:
        self.proc, self.err = proc, err
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def expect(self, kind: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"no {kind} after {timeout:.0f}s; "
                                   f"{self.err.read_text()[-1500:]}") from None
            if line is None:
                self.proc.wait(10)
                raise RuntimeError(f"side exited {self.proc.returncode} before {kind}: "
                                   f"{self.err.read_text()[-2000:]}")
            word, _, rest = line.partition(" ")
            if word == kind:
                return json.loads(rest)

    def tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()


def run_rounds(bed: Any, tmp: Path, pki_dir: Path, gateway: dict[str, str], *, codec: str,
               nbytes: int, rounds: int, gap: float, round_timeout: float
               ) -> dict[str, Any]:
    """Relays with `codec`, a side beside each; a warm-up round, then `rounds` timed rounds of
    an fp32 vector of `nbytes` per cluster. Per round: its start, each cluster's end and WAN
    bytes; every cluster's result must be the same bits."""
    sides: dict[str, _Side] = {}
    with relays(bed, tmp, pki_dir, gateway, codec):
        try:
            for cluster, host in gateway.items():
                err = tmp / f"side-{cluster}-{codec}.err"
                with open(err, "w") as f:
                    proc = bed.popen(host, [sys.executable, "-u", str(_bed.REPO / "bench" /
                                                                     "relay_goodput.py"),
                                            "--side", "relay", "--addr",
                                            f"127.0.0.1:{WORKER_PORT}", "--cluster", cluster,
                                            "--host", host, "--pki", str(pki_dir),
                                            "--bytes", str(nbytes), "--codec", codec,
                                            "--tmp", str(tmp),
                                            "--clusters-list", ",".join(gateway)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f,
                                     text=True, cwd=_bed.REPO, env=env())
                sides[cluster] = _Side(proc, err)
            ready = {c: s.expect("READY", 300) for c, s in sides.items()}
            out: list[dict[str, Any]] = []
            start = time.time()
            for r in range(rounds + 1):
                for s in sides.values():
                    s.tell(f"GO {r} {start:.6f}")
                done = {c: s.expect("DONE", round_timeout) for c, s in sides.items()}
                if len({d["sha256"] for d in done.values()}) != 1:
                    raise RuntimeError(f"{codec} round {r}: the clusters got different averages")
                if r:  # round 0 warms up
                    out.append({"start": start, "done": done})
                start = max(d["end"] for d in done.values()) + gap
            for s in sides.values():
                s.tell("END")
                s.proc.wait(30)
        finally:
            for s in sides.values():
                if s.proc.poll() is None:
                    s.proc.kill()
                    s.proc.wait(10)
    warnings = [line for c in gateway for line in
                (tmp / f"relay-{c}-{codec}.log").read_text().splitlines()
                if " WARNING " in line and "cannot reach peer" not in line]  # but at start-up
    for line in warnings[:5]:
        print(f"relay warning ({codec}): {line}", file=sys.stderr)
    return {"encoded_bytes": max(r["encoded_bytes"] for r in ready.values()), "rounds": out,
            "relay_warnings": len(warnings)}


def round_figures(run: dict[str, Any], rate_mbit: float, clusters: int) -> dict[str, Any]:
    """Round time against its bound, per timed round of `run_rounds`, and over all of them.

    The bound of a round is the busiest relay's WAN bytes of that round (frames as the relays
    count them: the encoded payload plus small headers; the larger of what it sent and what it
    received) at the line's rate: every byte a relay sends leaves through its cluster's uplink
    and every byte it receives comes through its downlink, each of `rate_mbit`. TLS, TCP/IP and
    Ethernet headers are on the line too and not in the bound, so a round cannot beat it."""
    rows = []
    for rnd in run["rounds"]:
        done = rnd["done"].values()
        busiest = max(max(d["bytes_sent"], d["bytes_received"]) for d in done)
        seconds = max(d["end"] for d in done) - rnd["start"]
        bound = busiest * 8 / (rate_mbit * 1e6)
        if {d["transport"] for d in done} != {"local"}:
            raise RuntimeError("a worker side did not reach its relay through its Unix socket")
        rows.append({"round_s": seconds, "bound_s": bound, "ratio": seconds / bound,
                     "busiest_bytes": busiest,
                     "relay_s": max(d["relay_s"] for d in done),
                     "error": max(d["error"] for d in done)})
    total = sum(r["round_s"] for r in rows)
    bound = sum(r["bound_s"] for r in rows)
    enc = run["encoded_bytes"]
    return {"round_vs_bound": total / bound, "round_vs_bound_max": max(r["ratio"] for r in rows),
            "round_s": total / len(rows), "bound_s": bound / len(rows),
            "encoded_mb": enc / 1e6,
            "busiest_bytes": sum(r["busiest_bytes"] for r in rows) / len(rows),
            "busiest_vs_encoded": sum(r["busiest_bytes"] for r in rows) / len(rows) / enc,
            "relay_s": sum(r["relay_s"] for r in rows) / len(rows),
            "error": max(r["error"] for r in rows), "rounds": rows, "clusters": clusters,
            "relay_warnings": run.get("relay_warnings", 0)}
