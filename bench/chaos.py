"""Goodput under faults: the same training job run twice in one invocation, fault-free and under
a failure schedule, on this machine (local transport, no root needed).

    .venv/bin/python bench/chaos.py [--quick] [--json] [--seed 1234] [--steps N] [--every S]

Two clusters (east, west: one host, one CPU worker each) train the small GPT of examples/gpt
through the relays (DiLoCo, int8), checkpointing every --checkpoint-every steps, with restarts
allowed. Run (a) has no fault. Run (b) draws, from --seed, one fault about every --every seconds
(uniform in [0.5, 1.5] x every) until the job ends:

  kill-worker   SIGKILL of a cluster's training process: its agent restarts it, it resumes
                from its newest checkpoint (the steps since are done again);
  kill-relay    SIGKILL of a cluster's relay: its agent restarts it, it resyncs from a peer;
  stall-relay   SIGSTOP of a relay for dead_after + 2 s, then SIGCONT (a silent peer / a cut
                link: its peers go on without it, it rejoins).

Both runs train the same number of steps on the same data, so the tokens of committed progress
are equal and goodput_vs_clean = wall time (a) / wall time (b), from `launch` to SUCCEEDED. Also
printed: faults_injected, lost_steps (steps trained again after restarts: the step a cluster had
reached before each restart minus the step it resumed from), params_identical (every worker of
(b) ends with the same parameters), eval_loss of both. Goal (issue 11): goodput_vs_clean >= 0.85
(Decoupled DiLoCo reports 0.88 under its failure schedule).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _local import GPT_DIR, REPO, Cli, records  # noqa: E402

FAULTS = ("kill-worker", "kill-relay", "stall-relay")
GOAL = 0.85
JSON_FIELDS = ("goodput_vs_clean", "faults_injected", "lost_steps", "params_identical",
               "eval_loss_clean", "eval_loss_faults")
"""Keys of the JSON object printed last with --json (plus settings, runs, faults)."""
QUICK = {"steps": 240, "every": 45.0}
FULL = {"steps": 900, "every": 120.0}


@dataclass
class Run:
    name: str
    seconds: float
    eval_loss: float | None
    params_identical: bool
    faults: list[dict[str, Any]] = field(default_factory=list)
    lost_steps: int = 0
    restarts: int = 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"a short run ({QUICK['steps']} steps, a fault every "
                        f"{QUICK['every']:g} s; under 10 minutes)")
    p.add_argument("--json", action="store_true", help="print a JSON object last")
    p.add_argument("--seed", type=int, default=1234, help="seed of the failure schedule")
    p.add_argument("--steps", type=int, help=f"training steps (default {FULL['steps']})")
    p.add_argument("--every", type=float, help=f"mean seconds between faults "
                                               f"(default {FULL['every']:g})")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--dead-after", type=float, default=6.0)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.steps = args.steps or preset["steps"]
    args.every = args.every or preset["every"]
    return args


def write_spec(tmp: Path, name: str, args: argparse.Namespace) -> Path:
    spec = yaml.safe_load((REPO / "templates" / "quickstart.yaml").read_text())
    spec.update(name=name, workdir=str(GPT_DIR), max_restarts=1000,
                run=f"python -u train.py --steps {args.steps} --eval-every "
                    f"{args.steps} --log-every 10",
                checkpoint={"every": args.checkpoint_every, "keep": 2, "dir": "checkpoints"})
    spec["clusters"] = [{"name": c, "transport": "local", "hosts": [{"host": h}]}
                        for c, h in (("east", "e1"), ("west", "w1"))]
    spec["relay"]["sync"]["inner_steps"] = args.inner_steps
    spec["relay"].update(timeout=30, heartbeat=1.0, dead_after=args.dead_after)
    spec["relay"].pop("shaping", None)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def process_of(cli: Cli, job_id: str, cluster: str, role: str) -> int | None:
    """The pid of `role`'s process in `cluster` (for a worker: its training process)."""
    for h in cli.status(job_id).get("hosts", []):
        if h["cluster"] == cluster and h["role"] == role and h["state"] == "RUNNING":
            pid = h.get("pid")
            if role == "worker" and pid:  # the agent runs `sh -c "python ..."`: its child
                kids = Path(f"/proc/{pid}/task/{pid}/children")
                with contextlib.suppress(OSError):
                    children = kids.read_text().split()
                    return int(children[0]) if children else pid
            return pid
    return None


def inject(cli: Cli, job_id: str, kind: str, cluster: str, dead_after: float) -> bool:
    pid = process_of(cli, job_id, cluster, "worker" if kind == "kill-worker" else "relay")
    if pid is None:
        return False
    try:
        if kind == "stall-relay":
            os.kill(pid, signal.SIGSTOP)
            time.sleep(dead_after + 2.0)
            os.kill(pid, signal.SIGCONT)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def run(cli: Cli, spec: Path, args: argparse.Namespace, faulty: bool) -> Run:
    t0 = time.monotonic()
    job_id = cli("launch", str(spec), "--detach", timeout=600).stdout.strip().splitlines()[-1]
    faults: list[dict[str, Any]] = []
    stop = threading.Event()

    def schedule() -> None:
        rng = random.Random(args.seed)
        while not stop.wait(args.every * rng.uniform(0.5, 1.5)):
            kind, cluster = rng.choice(FAULTS), rng.choice(["east", "west"])
            if inject(cli, job_id, kind, cluster, args.dead_after):
                faults.append({"at_s": round(time.monotonic() - t0, 1), "fault": kind,
                               "cluster": cluster})
                print(f"  {time.monotonic() - t0:7.1f}s  {kind} {cluster}", flush=True)

    injector = threading.Thread(target=schedule, daemon=True)
    if faulty:
        injector.start()
    try:
        while (st := cli.status(job_id)).get("state") in ("PENDING", "RUNNING", None):
            time.sleep(1.0)
    finally:
        stop.set()
        if faulty:
            injector.join(args.dead_after + 10)
        cli("stop", job_id, "--force")
    seconds = time.monotonic() - t0
    if st.get("state") != "SUCCEEDED":
        raise SystemExit(f"{spec.stem}: job {job_id} ended {st.get('state')}: {st.get('reason')}")
    recs = records(cli.home, job_id)
    finals = [r for r in recs if r.get("final")]
    losses = [r["eval_loss"] for r in finals if r.get("eval_loss") is not None]
    lost = 0
    for r in recs:
        if "resumed_from_step" in r and not r.get("final"):
            before = [x["step"] for x in recs if x.get("cluster") == r["cluster"]
                      and x.get("ts", 0) < r["ts"] and isinstance(x.get("step"), int)]
            lost += max(0, max(before, default=0) - r["resumed_from_step"])
    restarts = sum(h.get("restarts", 0) for h in st.get("hosts", []))
    return Run(spec.stem, seconds, sum(losses) / len(losses) if losses else None,
               len(finals) == 2 and len({r["param_sha256"] for r in finals}) == 1,
               faults, lost, restarts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nebula-chaos-") as tmp:
        cli = Cli(Path(tmp) / "home")
        print(f"chaos: {args.steps} steps, a fault every ~{args.every:g} s (seed {args.seed})",
              flush=True)
        print("(a) fault-free", flush=True)
        clean = run(cli, write_spec(Path(tmp), "clean", args), args, faulty=False)
        print(f"  {clean.seconds:.1f}s", flush=True)
        print("(b) under the failure schedule", flush=True)
        faulted = run(cli, write_spec(Path(tmp), "faults", args), args, faulty=True)
        print(f"  {faulted.seconds:.1f}s", flush=True)
    goodput = clean.seconds / faulted.seconds
    summary = {"goodput_vs_clean": round(goodput, 3), "faults_injected": len(faulted.faults),
               "lost_steps": faulted.lost_steps, "restarts": faulted.restarts,
               "params_identical": faulted.params_identical and clean.params_identical,
               "eval_loss_clean": clean.eval_loss, "eval_loss_faults": faulted.eval_loss,
               "seconds_clean": round(clean.seconds, 1),
               "seconds_faults": round(faulted.seconds, 1),
               "goal_met": goodput >= GOAL, "settings": {
                   "steps": args.steps, "every_s": args.every, "seed": args.seed,
                   "inner_steps": args.inner_steps, "checkpoint_every": args.checkpoint_every,
                   "dead_after": args.dead_after, "quick": args.quick},
               "faults": faulted.faults}
    print(f"\ngoodput vs fault-free   {goodput:.3f}   (goal >= {GOAL}; "
          f"{clean.seconds:.1f}s / {faulted.seconds:.1f}s)")
    print(f"faults injected         {len(faulted.faults)}  "
          f"({', '.join(f['fault'] for f in faulted.faults) or 'none'})")
    print(f"steps trained again     {faulted.lost_steps}")
    print(f"parameters identical    {summary['params_identical']}")
    print(f"eval loss               {clean.eval_loss} (fault-free)  {faulted.eval_loss} (faults)")
    if args.json:
        print(json.dumps({**summary, "runs": [asdict(clean), asdict(faulted)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
