"""A compressed month: one job trained for an hour (or --quick, a few minutes) under a seeded
schedule of faults, sampled for what only length shows (memory, descriptors, disk, `status`'s
time), then the same job without faults for goodput. On this machine (local transport; as root,
also a cut link and a full disk).

    .venv/bin/python bench/soak.py [--quick] [--json] [--seed 7] [--minutes M] [--out DIR]

The job: two clusters (east, west: one host, one CPU worker each) train the small GPT of
examples/gpt through the relays (DiLoCo, int8, the relays' WAN emulation at 50 Mbit/s and 25 ms
one way), a round every --inner-steps (2) steps, a checkpoint every 10 steps (keep 2), logs and
records rotated small (`logs: {max_mb: 0.25, keep: 2}`) so that rotation happens within the run.
Its step count is calibrated so that training takes about --minutes without faults.

Faults, drawn from --seed about every --every seconds (uniform in [0.5, 1.5] x every):
  kill-worker   SIGKILL of a cluster's training process (its agent restarts it);
  kill-relay    SIGKILL of a relay (its agent restarts it; it resyncs from a peer);
  stall-relay   SIGSTOP of a relay for dead_after + 2 s, then SIGCONT (a frozen relay);
  kill-agent    SIGKILL of a host's agent alone (the next `status` replaces it: `agent revive`);
  reboot-host   SIGKILL of a host's agent and everything it ran (a host reboot, as far as
                processes show one): the next `status` replaces the agent and restarts its work;
  cut-link      (root) every packet between the clusters' relays dropped for 10-40 s, then the
                link restored (nftables on loopback: a silent link, as a cut WAN link is);
  full-disk     (root) one host's checkpoint volume (a tmpfs of its own) filled until ENOSPC for
                30-90 s, then emptied;
and, after a fault, with probability 0.3 a second one 3 s later (a fault during the recovery
from the last). Once, half way, `nebula stop` then `nebula resume`. The faults are injected by
bench/_soak_faults.py.

Every --sample-every seconds (30; --quick: 10): RSS and open descriptors of every nebula process
by kind (agent, logpump, relay, worker), bytes on disk under `$NEBULA_HOME` (which holds the
local hosts' job directories), `state.db`, and the time of `nebula status JOB --json`; the
fault-free run is sampled the same way. Printed: per kind, the growth per 1,000 rounds (least
squares over each process's life after its first 20 %; the goal's is the fault-free run's,
whose processes live the whole run, and the run under faults' is printed beside it: its lives
are short, a restart every ~1,000 rounds, mostly warm-up) and the largest process, the status
time ratio (last 3 samples over the first 3), every worker's parameter checksum, goodput
against the fault-free run of the same steps, processes left. Plots (PNG) of both runs go to
--out. The last line is a JSON object (JSON_FIELDS).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _local import GPT_DIR, REPO, Cli, records  # noqa: E402
from _soak_faults import CheckpointVolumes, Injector, available  # noqa: E402
from _soak_sample import KINDS, Sample, growth, processes, take  # noqa: E402

JSON_FIELDS = ("rounds", "rss_growth_mb_per_1000_rounds", "fd_growth_per_1000_rounds",
               "disk_bytes_end", "disk_bound_bytes", "status_time_ratio", "goodput_vs_clean",
               "identical", "left_processes", "goals_met")
GOALS = {"rss_mb": 1.0, "status_ratio": 1.5, "goodput": 0.85}
QUICK = {"minutes": 4.0, "every": 40.0, "sample": 10.0}
FULL = {"minutes": 60.0, "every": 180.0, "sample": 30.0}
LOGS = {"max_mb": 0.25, "keep": 2}
CKPT_KEEP = 2
DEAD_AFTER = 6.0
HOLD_S = {"stall-relay": (DEAD_AFTER + 2, DEAD_AFTER + 2), "cut-link": (10.0, 40.0),
          "full-disk": (30.0, 90.0)}
HOSTS = {"east": "e1", "west": "w1"}


OUT_HELP = ("where the plots and the samples go (default: a new temporary folder, printed; "
            "the committed ones are docs/soak's, written only when named)")


def out_folder(given: Path | None) -> Path:
    """The folder --out names, or a new temporary one: a run never writes over tracked files
    unless told to."""
    out = given if given is not None else Path(tempfile.mkdtemp(prefix="nebula-soak-out-"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['minutes']:g} minutes of training per run, a fault every "
                        f"~{QUICK['every']:g} s (both runs within 15 minutes)")
    p.add_argument("--json", action="store_true", help="print a JSON object last (always)")
    p.add_argument("--seed", type=int, default=7, help="seed of the fault schedule")
    p.add_argument("--minutes", type=float, help="training minutes of the fault-free run "
                                                 f"(default {FULL['minutes']:g})")
    p.add_argument("--steps", type=int,
                   help="train this many steps: no calibration; --minutes then only places "
                        "the stop and resume (at its half)")
    p.add_argument("--every", type=float, help="mean seconds between faults")
    p.add_argument("--sample-every", type=float, help="seconds between samples")
    p.add_argument("--inner-steps", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.minutes = args.minutes or preset["minutes"]
    args.every = args.every or preset["every"]
    args.sample_every = args.sample_every or preset["sample"]
    return args


def write_spec(tmp: Path, name: str, steps: int, args: argparse.Namespace, *,
               model_args: str = "", checkpoint_every: int = 10, wan: bool = True) -> Path:
    """The job; its checkpoints under the absolute `<tmp>/checkpoints` (`<job id>/<cluster>/
    <host>` below it), where each host's may get a volume of its own. `model_args`: train.py's
    model options (the quickstart GPT without); `wan`: the relays' WAN emulation (the
    quickstart's) or none."""
    spec = yaml.safe_load((REPO / "templates" / "quickstart.yaml").read_text())
    spec.update(name=name, workdir=str(GPT_DIR), max_restarts=1000, logs=LOGS,
                run=f"python -u train.py --steps {steps} --eval-every {steps} --log-every 2"
                    + (f" {model_args}" if model_args else ""),
                checkpoint={"every": checkpoint_every, "keep": CKPT_KEEP,
                            "dir": str(tmp / "checkpoints")})
    spec["clusters"] = [{"name": c, "transport": "local", "hosts": [{"host": h}]}
                        for c, h in HOSTS.items()]
    spec["relay"]["sync"]["inner_steps"] = args.inner_steps
    spec["relay"].update(timeout=30, heartbeat=1.0, dead_after=DEAD_AFTER)
    if not wan:
        spec["relay"].pop("shaping", None)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@dataclass
class Outcome:
    """One run of the job to its end."""

    seconds: float
    status: dict[str, Any]
    samples: list[Sample]
    faults: list[dict[str, Any]]
    undone: list[dict[str, Any]]
    """When each lasting fault was undone (its hold, or before the stop or the end)."""
    job_id: str
    disk_bound: int
    """What the spec allows on disk (`disk_bound`), taken before the volumes go."""


def run(cli: Cli, spec: Path, args: argparse.Namespace, faults_here: tuple[str, ...], *,
        status_every: float | None = None) -> Outcome:
    """One job to its end: with `faults_here` (a fault schedule drawn from them, and the stop
    and resume half way), or without any. Each host's checkpoints get a volume of their own
    where this machine allows one (root), for both runs alike. `status_every`: seconds
    between `status` reads (the job's state, and the time one takes), at most one per sample
    (default: at every sample; a read takes about a second of a core, too much for samples
    a few seconds apart on two cores)."""
    faulty = bool(faults_here)
    ckpt_root = spec.parent / "checkpoints"
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:  # undone last to first: faults, job, volumes
        volumes = CheckpointVolumes(ckpt_root) if os.geteuid() == 0 else None
        if volumes is not None:
            stack.callback(volumes.close)
        job_id = cli("launch", str(spec), "--detach",
                     timeout=600).stdout.strip().splitlines()[-1]
        ended = False
        stack.callback(lambda: ended or cli("stop", job_id, "--force", timeout=300))
        if volumes is not None:
            try:
                volumes.mount(job_id, HOSTS)
            except OSError as exc:  # a checkpoint came first: this run goes without full-disk
                print(f"  no checkpoint volumes: {exc}", flush=True)
                volumes.close()
                volumes = None
                faults_here = tuple(f for f in faults_here if f != "full-disk")
        injector = Injector(job_id, cli.home / "jobs" / job_id, volumes)
        stack.callback(injector.close)
        rng = random.Random(args.seed)
        samples: list[Sample] = []
        faults: list[dict[str, Any]] = []
        undone: list[dict[str, Any]] = []
        next_fault = t0 + args.every * rng.uniform(0.5, 1.5)
        next_sample = next_status = t0
        resumed = not faulty
        half = t0 + args.minutes * 30
        while True:
            now = time.monotonic()
            for kind in injector.due():
                undone.append({"at_s": round(now - t0, 1), "undone": kind})
                print(f"  {now - t0:7.1f}s  {kind}: undone", flush=True)
            if now >= next_sample:
                took: float | None = None
                if now >= next_status:
                    a = time.monotonic()
                    st = cli.status(job_id)
                    took = time.monotonic() - a
                    next_status = now + (status_every or 0.0)
                samples.append(take(job_id, cli.home, now - t0, took,
                                    extra=[ckpt_root / job_id]))
                s = samples[-1]
                print(f"  {now - t0:7.1f}s  round {s.rounds:5d}  rss " + " ".join(
                    f"{k} {s.rss[k]:.0f}" for k in KINDS) + f"  disk {s.disk >> 20} MiB"
                    + ("" if took is None else f"  status {took:.2f}s"), flush=True)
                next_sample = now + args.sample_every
                if took is not None and st.get("state") not in ("PENDING", "RUNNING", None):
                    if injector.pending():  # a full volume's filler is not the job's disk
                        undone += [{"at_s": round(now - t0, 1), "undone": k, "at_end": True}
                                   for k in injector.due(everything=True)]
                        samples[-1] = take(job_id, cli.home, now - t0, took,
                                           extra=[ckpt_root / job_id])
                    break
            if faulty and not resumed and now >= half:
                print(f"  {now - t0:7.1f}s  stop, then resume", flush=True)
                undone += [{"at_s": round(now - t0, 1), "undone": k, "before_stop": True}
                           for k in injector.due(everything=True)]  # no fault overlaps it
                cli("stop", job_id, timeout=300)
                cli("resume", job_id, "--detach", timeout=600)
                faults.append({"at_s": round(now - t0, 1), "fault": "stop-resume"})
                resumed = True
            if faulty and now >= next_fault:
                kind, cluster = rng.choice(faults_here), rng.choice(list(HOSTS))
                chained = [kind] + ([rng.choice(faults_here)] if rng.random() < 0.3 else [])
                for i, k in enumerate(chained):
                    if i:
                        time.sleep(3.0)
                    low, high = HOLD_S.get(k, (0.0, 0.0))
                    if injector.inject(k, cluster, hold_s=rng.uniform(low, high)):
                        faults.append({"at_s": round(time.monotonic() - t0, 1), "fault": k,
                                       "cluster": cluster, "during_recovery": bool(i)})
                        print(f"  {time.monotonic() - t0:7.1f}s  {k} {cluster}"
                              + (" (during the recovery)" if i else ""), flush=True)
                next_fault = time.monotonic() + args.every * rng.uniform(0.5, 1.5)
            time.sleep(0.5)
        seconds = time.monotonic() - t0
        if st.get("state") != "SUCCEEDED":
            raise SystemExit(f"{spec.stem}: job {job_id} ended {st.get('state')}: "
                             f"{st.get('reason')}")
        bound = disk_bound(cli.home, ckpt_root, job_id)
        ended = True  # (an interrupt, an error, a job that failed: it is stopped, --force)
    return Outcome(seconds, st, samples, faults, undone, job_id, bound)


def terminate(*_: object) -> None:
    """SIGTERM: unwind (jobs stopped, volumes unmounted, faults undone), deaf to a second one
    while the cleanup runs."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def stop_every_job(cli: Cli) -> None:
    """Every job of the bench's `$NEBULA_HOME` stopped (--force), whatever state it is in: a
    launch cut short, the calibration's job, a run's job (already ended ones say so)."""
    for job in sorted((cli.home / "jobs").glob("*")):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            cli("stop", job.name, "--force", timeout=300)


def calibrate(cli: Cli, tmp: Path, args: argparse.Namespace) -> int:
    """Steps that take about --minutes of training here: a short job's step rate, from its
    records' times after its sixtieth step and before its last (DeepSpeed's start-up and
    first steps, the relays' and workers' warm-up over the first rounds, and the last step's
    evaluation are no step's time: with them the rate read slow, and soaks meant to train 50
    and 62 minutes under faults were done in 46 and 56, with a probe of 40 steps read from
    the tenth). It asks for the job's state every 15 s, near the runs' one `status` every
    30 s: a `status` takes about a second of a core, and asked every second it slowed the
    probe's steps by 14 % on two cores (0.48 s a step read, 0.42 trained in the run)."""
    probe, settled = 120, 60
    job_id = cli("launch", str(write_spec(tmp, "calibrate", probe, args)), "--detach",
                 timeout=600).stdout.strip().splitlines()[-1]
    deadline = time.monotonic() + 900
    while (state := cli.status(job_id).get("state")) in ("PENDING", "RUNNING", None):
        if time.monotonic() > deadline:
            raise SystemExit(f"calibration: job {job_id} still {state} after 15 minutes")
        time.sleep(15.0)
    points = sorted((r["step"], r["ts"]) for r in records(cli.home, job_id)
                    if isinstance(r.get("step"), int) and r.get("ts") and r["step"] >= settled
                    and not r.get("final") and "loss" in r
                    and "eval_loss" not in r)  # (the last step's eval is no step's time)
    per_step = ((points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])
                if len(points) > 1 and points[-1][0] > points[0][0] else 1.0)
    steps = int(args.minutes * 60 / per_step) // 10 * 10
    print(f"calibration: {per_step:.2f} s a step: {steps} steps for ~{args.minutes:g} min",
          flush=True)
    return max(steps, 60)


def disk_bound(home: Path, ckpt_root: Path, job_id: str) -> int:
    """What the spec allows on disk: every rotated file at its bound, checkpoints at keep + 1
    (one being written) of the largest seen, plus what does not grow (code, configs)."""
    job = home / "jobs" / job_id
    series = {str(p).split(".jsonl")[0].split(".log")[0] for p in job.glob("*/*/*/logs/*")}
    series |= {str(p).split(".jsonl")[0] for p in job.glob("*/*/*/metrics/*.jsonl*")}
    series |= {str(p) for p in job.glob("*/*/*/events.jsonl")}
    series |= {str(p) for p in job.glob("*/*/*/agent.log")}
    per_file = (LOGS["keep"] + 1) * (int(LOGS["max_mb"] * (1 << 20)) + (64 << 10))
    ckpts = [sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
             for d in ckpt_root.glob(f"{job_id}/*/*/step*")]
    hosts = len(list(job.glob("*/*/worker")))
    fixed = 64 << 20  # agent.json, certificates, summaries, state.db, launch.log, pki
    return len(series) * per_file + hosts * (CKPT_KEEP + 1) * max(ckpts, default=0) + fixed


def plot(samples: list[Sample], out: Path, label: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out.mkdir(parents=True, exist_ok=True)
    made = []
    xs = [s.rounds for s in samples]
    for name, values, unit in (
            ("rss", lambda k: [s.rss[k] for s in samples], "RSS (MiB, summed per kind)"),
            ("fds", lambda k: [s.fds[k] for s in samples], "open descriptors (per kind)")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in KINDS:
            ax.plot(xs, values(k), marker=".", label=k)
        ax.set_xlabel("rounds")
        ax.set_ylabel(unit)
        ax.legend()
        ax.set_title(f"soak ({label}): {name} against rounds")
        path = out / f"soak-{label}-{name}.png"
        fig.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(fig)
        made.append(str(path))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [s.disk / (1 << 20) for s in samples], marker=".", label="$NEBULA_HOME")
    ax.plot(xs, [s.state_db / (1 << 20) for s in samples], marker=".", label="state.db")
    ax.set_xlabel("rounds")
    ax.set_ylabel("MiB on disk")
    ax.legend()
    ax.set_title(f"soak ({label}): disk against rounds")
    path = out / f"soak-{label}-disk.png"
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    made.append(str(path))
    return made


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, terminate)  # (SIGINT too; a shell's background job ignores it)
    label = ("quick" if args.quick else f"{args.steps}steps" if args.steps
             else f"{args.minutes:g}min")
    with tempfile.TemporaryDirectory(prefix="nebula-soak-") as tmp, \
            contextlib.ExitStack() as stack:
        cli = Cli(Path(tmp) / "home")
        stack.callback(stop_every_job, cli)
        steps = args.steps or calibrate(cli, Path(tmp), args)
        kinds, left_out = available()
        print(f"(a) under faults: {steps} steps, a round every {args.inner_steps} steps, "
              f"a fault every ~{args.every:g} s (seed {args.seed}): {', '.join(kinds)}"
              + (f" ({left_out})" if left_out else ""), flush=True)
        faulted = run(cli, write_spec(Path(tmp), "soak", steps, args), args, kinds)
        secs, st, samples, faults, job_id = (faulted.seconds, faulted.status, faulted.samples,
                                             faulted.faults, faulted.job_id)
        recs = records(cli.home, job_id)
        last: dict[str, dict[str, Any]] = {}  # each cluster's last final record (a stop, a
        for r in sorted((r for r in recs if r.get("final")), key=lambda r: r.get("ts", 0)):
            last[r.get("cluster", "?")] = r  # revive's graceful end, the end: each writes one)
        finals = list(last.values())
        sums = sorted(f"{c}: {r.get('param_sha256')}" for c, r in last.items())
        end_disk, bound = samples[-1].disk, faulted.disk_bound
        time.sleep(3)
        left = sum(len(v) for v in processes(job_id).values())
        args.out = out_folder(args.out)  # kept before (b), should (b) not end
        (args.out / f"soak-{label}-samples.json").write_text(
            json.dumps([asdict(s) for s in samples]))
        plots = plot(samples, args.out, label)
        print(f"(a) took {secs:.0f} s, {len(faults)} faults; samples and plots in {args.out}; "
              f"checksums {'; '.join(sums)}; processes left {left}", flush=True)
        print("(b) fault-free, the same steps", flush=True)
        clean = run(cli, write_spec(Path(tmp), "clean", steps, args), args, ())
        clean_s = clean.seconds
        (args.out / f"soak-{label}-clean-samples.json").write_text(
            json.dumps([asdict(s) for s in clean.samples]))
        plots += plot(clean.samples, args.out, f"{label}-clean")
    # Growth is fitted per process life. Under faults each life is short (a restart every
    # ~1,000 rounds) and mostly warm-up; the fault-free run's processes live the whole run:
    # its fit is the one a leak cannot hide from, and the goal's.
    under_faults = growth(samples, warmup=0.2)
    grown = growth(clean.samples, warmup=0.2)
    peak = {k: round(max(max((v[0] for v in s.per_pid.get(k, {}).values()), default=0.0)
                         for s in samples + clean.samples), 1) for k in KINDS}
    asked = [s.status_s for s in samples if s.status_s is not None]
    first, last = asked[:3], asked[-3:]
    ratio = (sum(last) / len(last)) / (sum(first) / len(first)) if first else 0.0
    identical = len(finals) == 2 and len({r.get("param_sha256") for r in finals}) == 1
    goodput = clean_s / secs
    goals = (all(v <= GOALS["rss_mb"] for v in grown["rss_mb"].values())
             and end_disk <= bound and ratio <= GOALS["status_ratio"]
             and goodput >= GOALS["goodput"] and identical and left == 0)
    print(f"\nrounds                  {samples[-1].rounds}")
    for k in KINDS:
        print(f"{k:8s} growth/1000 rounds  rss {grown['rss_mb'][k]:+.3f} MiB  "
              f"fds {grown['fds'][k]:+.3f}  (under faults {under_faults['rss_mb'][k]:+.3f} "
              f"MiB, {under_faults['fds'][k]:+.3f}); largest process {peak[k]:.0f} MiB")
    print(f"disk at the end         {end_disk >> 20} MiB (bound {bound >> 20} MiB)")
    print(f"status time ratio       {ratio:.2f}  (last 3 samples / first 3)")
    print(f"goodput vs fault-free   {goodput:.3f}  ({clean_s:.0f} s / {secs:.0f} s)")
    print(f"faults                  {len(faults)}: "
          + ", ".join(f["fault"] for f in faults))
    print("parameter checksums     " + "; ".join(sums))
    print(f"processes left          {left}")
    print(f"plots                   {', '.join(plots) or 'none (no matplotlib)'}")
    summary = {"rounds": samples[-1].rounds, "rss_growth_mb_per_1000_rounds": grown["rss_mb"],
               "fd_growth_per_1000_rounds": grown["fds"], "disk_bytes_end": end_disk,
               "disk_bound_bytes": bound, "status_time_ratio": round(ratio, 3),
               "goodput_vs_clean": round(goodput, 3), "identical": identical,
               "left_processes": left, "goals_met": goals,
               "settings": {"seed": args.seed, "minutes": args.minutes, "steps": steps,
                            "every_s": args.every, "inner_steps": args.inner_steps,
                            "sample_every_s": args.sample_every, "quick": args.quick},
               "seconds_faults": round(secs, 1), "seconds_clean": round(clean_s, 1),
               "faults": faults, "undone": faulted.undone, "final_state": st.get("state"),
               "rss_growth_under_faults": under_faults["rss_mb"],
               "fd_growth_under_faults": under_faults["fds"], "rss_peak_mb": peak,
               "clean_rounds": clean.samples[-1].rounds if clean.samples else 0}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
