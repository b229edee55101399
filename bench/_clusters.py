"""bench/relay_goodput.py --clusters N (N >= 3): one outer round's time against its bandwidth
bound on the test bed's per-cluster lines, per codec, beside plain TCP moving the same bytes
between the same hosts at once (bench/_mesh.py). The bench's docstring says what is measured;
this module runs it, summarises it (the JSON) and prints it."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import _bed
import _mesh
import _relays

JSON_FIELDS = ("round_vs_bound", "clusters", "round_vs_bound_all_to_all", "link_mbit",
               "params_identical")
"""Keys of the JSON object printed first (plus "tcp_vs_bound", "topology", "tcp", "bound",
"goals_met", "training", "codecs", "settings"); params_identical is None without the job."""
GOALS = {"round_vs_bound": ("<=", 1.25)}
QUICK = {"mb": 32, "rounds": 2}
SHARD_CODECS = ("none", "int8")
"""Codecs that average in shard mode with 3 clusters or more (dense); topk is all-to-all."""
TOPOLOGY = "one line per cluster (tc htb, --mbit each way, shared fairly by its peers)"
TCP = "reno"
"""The hosts' TCP by default: loss-based, as Linux's default cubic (the bench's docstring)."""


def system_tcp() -> str:
    """This machine's default TCP congestion control."""
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        return "?"


def gateways(n: int) -> dict[str, list[str]]:
    """Cluster c<i> of one host g<i>, for i = 1..n."""
    return {f"c{i}": [f"g{i}"] for i in range(1, n + 1)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Round time against the bound, per codec (relay_goodput.py's docstring)."""
    from nebula_cli.pki import issue_job_pki

    clusters = gateways(args.clusters)
    nbytes = (args.mb << 20) // 4 * 4
    tmp = Path(tempfile.mkdtemp(prefix="nebula-bench-rounds-"))
    out: dict[str, Any] = {}
    try:
        pki = tmp / "pki"
        issue_job_pki(_relays.JOB, clusters, pki, valid_for=datetime.timedelta(days=1))
        with _bed.make_bed(clusters, args.mbit, link="cluster", tcp=args.tcp) as bed:
            gateway = {c: hosts[0] for c, hosts in clusters.items()}
            for codec in args.codec_list:
                _bed.say(f"{args.clusters} clusters, codec {codec}: {args.mb} MiB per "
                         f"cluster, warm-up + {args.rounds} rounds ...")
                run = _relays.run_rounds(bed, tmp, pki, gateway, codec=codec, nbytes=nbytes,
                                         rounds=args.rounds, gap=args.gap,
                                         round_timeout=600 + nbytes * 8 * args.clusters
                                         / 1e6 / args.mbit * 3)
                out[codec] = _relays.round_figures(run, args.mbit, args.clusters)
                fig = out[codec]
                fig["mode"] = "shard" if codec in SHARD_CODECS else "all-to-all"
                per_pair = round(fig["busiest_bytes"] / (args.clusters - 1))
                _bed.say(f"codec {codec}: plain TCP, {per_pair / 1e6:.1f} MB each way "
                         f"between every two hosts at once ...")
                fig["tcp_s"] = _mesh.run(bed, tmp, list(gateway.values()), per_pair,
                                         timeout=300 + 3 * fig["bound_s"])
                fig["tcp_vs_bound"] = fig["tcp_s"] / (per_pair * (args.clusters - 1) * 8
                                                      / (args.mbit * 1e6))
                fig["round_vs_tcp"] = fig["round_s"] / fig["tcp_s"]
                _bed.say(f"codec {codec}: round {fig['round_s']:.2f} s, bound "
                         f"{fig['bound_s']:.2f} s (ratio {fig['round_vs_bound']:.3f}); plain TCP "
                         f"{fig['tcp_s']:.2f} s (ratio {fig['tcp_vs_bound']:.3f}) ...")
            if args.train_steps:
                out["_train"] = train(bed, tmp, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def summarize(per_codec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON object (JSON_FIELDS first) of a --clusters N >= 3 run."""
    per_codec = dict(per_codec)
    job = per_codec.pop("_train", None)
    shard = [per_codec[c]["round_vs_bound"] for c in per_codec if c in SHARD_CODECS]
    a2a = [per_codec[c]["round_vs_bound"] for c in per_codec if c not in SHARD_CODECS]
    out: dict[str, Any] = {
        "round_vs_bound": round(max(shard), 4) if shard else None,
        "clusters": args.clusters,
        "round_vs_bound_all_to_all": round(max(a2a), 4) if a2a else None,
        "link_mbit": args.mbit,
        "params_identical": job["params_identical"] if job else None,
        "tcp_vs_bound": round(max(per_codec[c]["tcp_vs_bound"] for c in per_codec
                                  if c in SHARD_CODECS), 4) if shard else None,
        "topology": TOPOLOGY,
        "tcp": args.tcp_label,
        "bound": "busiest relay's WAN bytes per round (max of sent, received) / line rate; "
                 "shard: ~2(N-1)/N of the encoded vector, all-to-all: (N-1) contributions",
    }
    out["goals_met"] = {k: out[k] is not None and out[k] <= v for k, (_, v) in GOALS.items()}
    if job:
        out["goals_met"]["trained"] = job["job_state"] == "SUCCEEDED" and job["params_identical"]
    out["training"] = job
    out["codecs"] = {c: {k: (round(v, 4) if isinstance(v, float) else v)
                         for k, v in f.items() if k != "rounds"} | {
                             "round_s_each": [round(r["round_s"], 3) for r in f["rounds"]],
                             "bound_s_each": [round(r["bound_s"], 3) for r in f["rounds"]]}
                     for c, f in per_codec.items()}
    out["settings"] = {"mb": args.mb, "rounds": args.rounds, "gap": args.gap, "tcp": args.tcp,
                       "quick": args.quick, "codecs": args.codec_list,
                       "train_steps": args.train_steps, "train_h": args.train_h}
    return out


def show(summary: dict[str, Any], args: argparse.Namespace) -> None:
    rows = [[c, f["mode"], f["encoded_mb"], f["busiest_vs_encoded"], f["round_s"], f["bound_s"],
             f["round_vs_bound"], f["round_vs_bound_max"], f["relay_s"], f["tcp_s"],
             f["tcp_vs_bound"], f["round_vs_tcp"], f["error"]]
            for c, f in summary["codecs"].items()]
    print(_bed.table(["codec", "algorithm", "encoded MB", "busiest/enc.", "round s",
                      "bound s", "round/bound", "worst round", "relay's s", "TCP s",
                      "TCP/bound", "round/TCP", "rel. error"], rows))
    print()
    goal = summary["goals_met"]["round_vs_bound"]
    print(_bed.table(["ratio", "value", "goal", ""], [
        ["round_vs_bound (none, int8: shard)", summary["round_vs_bound"], "<= 1.25",
         "met" if goal else "NOT met"],
        ["round_vs_bound_all_to_all (topk)", summary["round_vs_bound_all_to_all"], "", ""],
        ["tcp_vs_bound (plain TCP, same bytes)", summary["tcp_vs_bound"], "", ""]]))
    job = summary["training"]
    if job:
        print(f"\n{args.clusters}-cluster job (examples/gpt, one worker per cluster, over SSH, "
              f"{args.train_steps} steps, H={args.train_h}, default compression, modes "
              f"{job['modes']}): {job['job_state']}, {job['workers_final']} workers ended, "
              f"parameters {'identical' if job['params_identical'] else 'DIFFERENT'}, "
              f"{job['rounds_all_present']} rounds with every cluster, eval loss "
              f"{job['eval_loss']}, {job['wall_s']} s.")
    print(f"\n{args.clusters} clusters, {TOPOLOGY}, {args.mbit:g} Mbit/s, no added delay, "
          f"hosts' TCP {args.tcp_label}; "
          f"{args.mb} MiB of fp32 per cluster per round; bound = {summary['bound']}. "
          f"busiest/encoded: the busiest relay's bytes per round / one encoded contribution "
          f"(shard {2 * (args.clusters - 1) / args.clusters:.2f}, all-to-all "
          f"{args.clusters - 1}). TCP s: plain TCP moving the busiest relay's bytes per peer "
          f"between every two hosts at once (TCP/bound: against the bound of those bytes). "
          f"{os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}.")


def train(bed: Any, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The small GPT of examples/gpt trained by every cluster of the bed (one worker each, over
    SSH, `nebula launch` as a user runs it, the spec's default compression): the job's state,
    whether every worker ended with the same parameters, the rounds all clusters were in."""
    clusters = gateways(args.clusters)
    neb = _bed.Nebula(bed, tmp / "home")
    cfg = json.loads((_bed.GPT_DIR / "ds_config.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 4
    spec = _bed.ssh_spec(
        tmp / "train.yaml", bed, name="bench-clusters", clusters=clusters,
        run=f"python -u train.py --steps {args.train_steps} --eval-every {args.train_steps} "
            f"--log-every 5 --seed 1234 --context 128",
        relay={"sync": {"mode": "diloco", "inner_steps": args.train_h}, "timeout": 300},
        deepspeed=cfg)
    _bed.say(f"{args.clusters}-cluster job: {args.train_steps} steps, a round every "
             f"{args.train_h} (nebula launch over SSH) ...")
    t0 = time.monotonic()
    try:
        job_id = neb.run_job(spec, timeout=900 + 30 * args.train_steps, log=tmp / "train.log")
        status = json.loads(neb("status", job_id, "--json", timeout=120).stdout)
        finals = [r for r in _bed.worker_records(job_id) if r.get("final")]
        rounds = _bed.relay_records(job_id)
    finally:
        neb.cleanup()
    full = {r["round"] for r in rounds if len(r.get("present", [])) == args.clusters}
    return {"job_state": status.get("state"),
            "params_identical": len(finals) == args.clusters
            and len({r["param_sha256"] for r in finals}) == 1,
            "workers_final": len(finals), "rounds_all_present": len(full),
            "modes": sorted({r.get("mode") for r in rounds}),
            "eval_loss": [round(float(r["eval_loss"]), 4) for r in finals],
            "wall_s": round(time.monotonic() - t0, 1)}
