"""bench/peers.py's jobs on the test bed: each system trains once and leaves its records.

- `run_nebula`: a nebula job through the real CLI (`nebula launch` over the bed's SSH, as
  bench/wan_training.py runs it): flat DeepSpeed (one cluster of the four hosts, no relay) or
  nebula's relay DiLoCo with a codec. Its records are the workers' metrics files.
- `run_torchft`: torchft's lighthouse on e1, then one `bench/_peers_torchft.py` per host in the
  torchft venv (a replica group per cluster).
- `run_hivemind`: a hivemind DHT bootstrap peer on e1, then one `bench/_peers_hivemind.py` per
  host in the hivemind venv (every worker a peer).

Every job returns a `Job`: the records (nebula's metrics JSON lines, or the same keys from
bench/_peers_train.Log), the bytes the router counted between the clusters during the job
(`_bed.link_bytes`), its wall time and the tokens of one step of all workers. Every process a
job starts runs in a bed host's namespace and is ended before the job returns.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _bed
import _peers_train
from _peers_procs import Procs, read_maddr

HERE = Path(__file__).resolve().parent
LIGHTHOUSE_PORT = 29510
STORE_PORT = 29620


@dataclass
class Job:
    """What one system's job left."""

    name: str
    records: list[dict[str, Any]]
    wan_bytes: int
    wall_s: float
    tokens_per_step: int
    steps: int
    workers: int
    notes: dict[str, Any] = field(default_factory=dict)


def tokens_per_step(workers: int, micro_batch: int) -> int:
    return workers * micro_batch * _peers_train.CONTEXT


# --------------------------------------------------------------------------------- nebula

def run_nebula(neb: _bed.Nebula, bed: Any, tmp: Path, *, name: str,
               clusters: dict[str, list[str]], relay: dict[str, Any] | None, steps: int,
               eval_every: int, micro_batch: int, seed: int) -> Job:
    """One nebula job (flat when `relay` is None) until it ends; its records."""
    cfg = json.loads((_bed.GPT_DIR / "ds_config.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    run = (f"python -u train.py --steps {steps} --eval-every {eval_every} --log-every 10 "
           f"--seed {seed} --context {_peers_train.CONTEXT}")
    spec = _bed.ssh_spec(tmp / f"{name}.yaml", bed, name=f"peers-{name}", clusters=clusters,
                         run=run, relay=relay, deepspeed=cfg)
    workers = sum(len(h) for h in clusters.values())
    before = _bed.link_bytes(bed)
    t0 = time.monotonic()
    job_id = neb.run_job(spec, timeout=900 + 60 * steps, log=tmp / f"{name}.log")
    wall = time.monotonic() - t0
    wan = _bed.link_bytes(bed) - before
    records = _bed.worker_records(job_id)
    relays = _bed.relay_records(job_id)
    shutil.rmtree(_bed.REMOTE_JOBS / job_id, ignore_errors=True)
    codecs = sorted({str(r["codec"]) for r in relays if r.get("codec")})
    return Job(name, records, wan, wall, tokens_per_step(workers, micro_batch), steps, workers,
               notes={"codecs_used": codecs} if codecs else {})


# ----------------------------------------------------------------------------- the peers

def _records(paths: list[Path]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in paths:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    out.append(json.loads(line))
    return out


def run_torchft(bed: Any, tmp: Path, python: Path, *, clusters: dict[str, list[str]],
                steps: int, sync_every: int, outer_lr: float, outer_momentum: float,
                micro_batch: int, seed: int) -> Job:
    """torchft DiLoCo: the lighthouse on the first cluster's first host, a replica group per
    cluster (its first host holds the group's TCPStore), one worker per host."""
    procs = Procs(bed, tmp, "torchft")
    names = list(clusters)
    first = bed.hosts[clusters[names[0]][0]].address
    lighthouse = f"http://{first}:{LIGHTHOUSE_PORT}"
    metrics: list[Path] = []
    before = _bed.link_bytes(bed)
    t0 = time.monotonic()
    try:
        procs.start("lighthouse", clusters[names[0]][0], [
            str(python.parent / "torchft_lighthouse"), "--min_replicas", str(len(clusters)),
            "--bind", f"{first}:{LIGHTHOUSE_PORT}", "--quorum_tick_ms", "100",
            "--join_timeout_ms", "10000"], {"RUST_BACKTRACE": "1"})
        bed.wait_listening(clusters[names[0]][0], LIGHTHOUSE_PORT, timeout=30)
        workers = []
        for c, cluster in enumerate(names):
            hosts = clusters[cluster]
            master = bed.hosts[hosts[0]].address
            for rank, host in enumerate(hosts):
                path = tmp / f"torchft-{host}.jsonl"
                metrics.append(path)
                label = f"worker-{host}"
                workers.append(label)
                procs.start(label, host, [
                    str(python), "-u", str(HERE / "_peers_torchft.py"), "--cluster", str(c),
                    "--address", bed.hosts[host].address, "--lighthouse", lighthouse,
                    "--steps", str(steps), "--sync-every", str(sync_every),
                    "--outer-lr", str(outer_lr), "--outer-momentum", str(outer_momentum),
                    "--micro-batch", str(micro_batch), "--seed", str(seed),
                    "--replicas", str(len(clusters)), "--metrics", str(path)],
                    {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(len(hosts)),
                     "MASTER_ADDR": master, "MASTER_PORT": str(STORE_PORT)})
        procs.wait(workers, timeout=600 + 30 * steps)
    finally:
        procs.stop()
    wall = time.monotonic() - t0
    n = sum(len(h) for h in clusters.values())
    return Job("torchft", _records(metrics), _bed.link_bytes(bed) - before, wall,
               tokens_per_step(n, micro_batch), steps, n)


def run_hivemind(bed: Any, tmp: Path, python: Path, *, clusters: dict[str, list[str]],
                 steps: int, sync_every: int, micro_batch: int, seed: int) -> Job:
    """hivemind: a bootstrap DHT peer on the first host, then every worker a peer whose
    hivemind.Optimizer averages parameters with the others every `sync_every` steps' worth of
    samples of all workers (target_batch_size). The workers start one after the other, each
    joining the bootstrap and every worker before it (bench/_peers_hivemind.py says why), and
    take their first step together once the last one is ready."""
    procs = Procs(bed, tmp, "hivemind")
    hosts = [h for hs in clusters.values() for h in hs]
    first = hosts[0]
    metrics: list[Path] = []
    before = _bed.link_bytes(bed)
    t0 = time.monotonic()
    script = str(HERE / "_peers_hivemind.py")
    try:
        boot = procs.start("dht", first, [str(python), "-u", script, "--dht-only", "--address",
                                          bed.hosts[first].address], {},
                           stdout=subprocess.PIPE, text=True)
        maddr = read_maddr(boot, procs.log("dht"), timeout=120)
        if maddr is None:
            raise RuntimeError(f"hivemind's bootstrap DHT peer on {first} printed no address:\n"
                               f"{procs.tail('dht')}")
        workers: list[str] = []
        joined = [maddr]
        go = tmp / "hivemind-go"
        go.unlink(missing_ok=True)
        for c, members in enumerate(clusters.values()):
            for rank, host in enumerate(members):
                path = tmp / f"hivemind-{host}.jsonl"
                metrics.append(path)
                label = f"worker-{host}"
                workers.append(label)
                peers = [x for m in joined for x in ("--initial-peer", m)]
                proc = procs.start(label, host, [
                    str(python), "-u", script, "--cluster", str(c), "--rank", str(rank),
                    "--address", bed.hosts[host].address, *peers,
                    "--peers", str(len(hosts)), "--steps", str(steps),
                    "--sync-every", str(sync_every), "--micro-batch", str(micro_batch),
                    "--seed", str(seed), "--metrics", str(path), "--go-file", str(go)], {},
                    stdout=subprocess.PIPE, text=True)
                # its DHT runs: the next peer joins it too
                own = read_maddr(proc, procs.log(label), timeout=120)
                if own is None:
                    raise RuntimeError(f"hivemind peer on {host} printed no address:\n"
                                       f"{procs.tail(label)}")
                joined.append(own)
        go.touch()  # every peer is in the swarm: all start their first step now
        procs.wait(workers, timeout=600 + 30 * steps)
        rounds = averaging_rounds(procs, workers)
    finally:
        procs.stop()
    wall = time.monotonic() - t0
    if not rounds["averaged"]:
        raise RuntimeError(
            f"hivemind trained but its peers never averaged ({rounds['failed']} failed "
            f"averaging rounds in the workers' logs, 0 'Averaged parameters with N peers'); "
            f"the first failures: {' | '.join(rounds['first_failures'])}")
    return Job("hivemind", _records(metrics), _bed.link_bytes(bed) - before, wall,
               tokens_per_step(len(hosts), micro_batch), steps, len(hosts), notes=rounds)


def averaging_rounds(procs: Procs, labels: list[str]) -> dict[str, Any]:
    """What hivemind's own log lines (verbose=True) say of its averaging rounds, all workers:
    rounds that averaged (and with how many peers), rounds that failed, the first failures."""
    averaged: list[int] = []
    failed: list[str] = []
    for label, _, log in procs.procs:
        if label not in labels or not log.exists():
            continue
        for line in log.read_text(errors="replace").splitlines():
            if "Averaged parameters with" in line:
                averaged.append(int(line.split("Averaged parameters with")[1].split()[0]))
            elif "Averaging failed" in line or "Averaging step failed" in line:
                failed.append(f"{label}: {line.strip()[:160]}")
    return {"averaged": len(averaged), "peers_per_round": sorted(set(averaged)),
            "failed": len(failed), "first_failures": failed[:3]}
