#!/usr/bin/env bash
# The check for one single-GPU Linux machine (issue 28): nebula as it is, on CUDA, in < 8 min.
#
#   scripts/gpu-check.sh [--dry-run] [--python PY] [--wheels DIR] [--steps N] [--out FILE]
#
# What it runs (each part's figures or its error go into the JSON line printed last):
#   1. environment: python, torch, CUDA, the GPU's name, deepspeed, nebula.
#   2. codecs: each WAN codec's (none, fp16, int8, topk) encode and decode GB/s of fp32 input
#      on the GPU (a CUDA tensor handed to the codec as the runtime hands it) against the CPU.
#   3. params: the outer round's host copies of 1 GiB of parameters (read to one flat fp32
#      vector, written back) through pinned chunks (runtime.host_transfer) vs pageable copies.
#   4. quickstart: examples/gpt on two clusters of one rank each sharing the GPU (`nebula
#      launch`, local transport, DeepSpeed with NCCL inside each cluster, relays between them,
#      int8, an outer round every H steps): the job's state, eval loss, s/step, whether both
#      workers ended with the same parameters, and the relay's round time with CUDA tensors
#      (the workers' round_s).
#   5. distill: examples/distill (phase b) as its nebula.yaml says (the defaults: 12 sampled
#      labels a token), then with the teacher's top 32: a
#      GPT-2 teacher served on the GPU by one cluster, the example's student trained on the GPU
#      by another through the label relay: the teacher's answers/s and latency, the student's
#      bytes per token, batches without labels, its eval loss and device.
#   6. bad_ask: a serving rank with a GPT-2 on the GPU given asks its model cannot run (an id
#      at its vocabulary, sequences past its positions): they fail alone, before the model
#      sees them (no device-side assert), and a good ask is answered after them.
#   7. hook: examples/ds_plain (an unmodified DeepSpeed script, nebula's automatic hook) the
#      same way: its exit path with NCCL (the job ends SUCCEEDED, no worker left running).
# --dry-run: the same on this machine's CPU (gloo, smaller sizes) so that CI keeps it working;
# it says "device": "cpu". Without --dry-run and without CUDA it stops with exit 2.
# --wheels DIR: `pip install --no-index --find-links DIR nebula-cli deepspeed` first (a machine
# with no network: bring torch's CUDA wheel, deepspeed, this project's wheel and their deps).
# Exit status: 0 when every part passed, 1 when one failed (the JSON says which), 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0 PY="" WHEELS="" STEPS="" OUT=""
usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --python) PY="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(command -v python3); fi
fi
if [ -n "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" deepspeed nebula-cli
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nebula-gpu-check.XXXXXX")
cleanup() {  # nothing left running: every job of this check stopped, its files removed
  for job in "$WORK"/home/jobs/*; do
    [ -e "$job" ] && NEBULA_HOME="$WORK/home" "$PY" -m nebula_cli stop "$(basename "$job")" \
      --force >/dev/null 2>&1 || true
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 143' TERM INT  # through cleanup: a killed check leaves no job running
export NEBULA_HOME="$WORK/home" GPU_CHECK_DRY="$DRY" GPU_CHECK_STEPS="$STEPS" GPU_CHECK_OUT="$OUT" \
  GPU_CHECK_WORK="$WORK" NO_COLOR=1 COLUMNS=200 PYTHONUNBUFFERED=1

"$PY" - "$@" <<'PYTHON'  # the JSON line also into --out (alone: libraries print to stdout too)
"""gpu-check's body: each part below records its figures or its error; one JSON line last."""
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import yaml

REPO = Path.cwd()
DRY = os.environ["GPU_CHECK_DRY"] == "1"
WORK = Path(os.environ["GPU_CHECK_WORK"])
STEPS = int(os.environ.get("GPU_CHECK_STEPS") or (6 if DRY else 40))
H = 3 if DRY else 10
result = {"device": None, "dry_run": DRY, "parts": {}, "errors": []}


def part(name):
    """Run the decorated function at once as one part: its dict, or its error (the part's name
    and the exception's last lines). Helpers a part calls are defined above it."""
    def wrap(fn):
        t0 = time.monotonic()
        try:
            result["parts"][name] = {**fn(), "s": round(time.monotonic() - t0, 1)}
        except Exception as exc:  # every part is reported, the next still runs
            tb = traceback.format_exc().strip().splitlines()[-6:]
            result["parts"][name] = {"error": f"{type(exc).__name__}: {exc}", "trace": tb}
            result["errors"].append(name)
        print(f"gpu-check: {name}: {json.dumps(result['parts'][name])[:300]}", file=sys.stderr,
              flush=True)
    return wrap


@part("environment")
def environment():
    import torch
    cuda = torch.cuda.is_available()
    if not DRY and not cuda:
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False); "
              "--dry-run runs on the CPU", file=sys.stderr)
        sys.exit(2)
    result["device"] = "cpu" if DRY else "cuda"
    import deepspeed
    import nebula_cli
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "deepspeed": deepspeed.__version__,
            "nebula": getattr(nebula_cli, "__version__", "?")}


@part("codecs")
def codecs():
    import torch
    from nebula_cli.relay.codecs.registry import KNOWN_CODECS, get_codec
    n = (8 if DRY else 64) << 20
    devices = ["cpu"] + ([] if DRY else ["cuda"])
    out = {}
    for name in [c for c in ("none", "fp16", "int8", "topk") if c in KNOWN_CODECS]:
        codec = get_codec(name)
        for dev in devices:
            x = torch.randn(n, device=dev) * 1e-3
            try:
                codec.encode(x)  # warm-up
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                enc = codec.encode(x)
                t1 = time.perf_counter()
                y = codec.decode(enc)
                if dev == "cuda":
                    y = y.to("cuda")
                    torch.cuda.synchronize()
                t2 = time.perf_counter()
                err = float((y.to(x.device) - x).abs().max())
                out[f"{name}/{dev}"] = {"encode_gbs": round(n * 4 / (t1 - t0) / 1e9, 3),
                                        "decode_gbs": round(n * 4 / (t2 - t1) / 1e9, 3),
                                        "max_abs_error": err}
            except Exception as exc:
                out[f"{name}/{dev}"] = {"error": f"{type(exc).__name__}: {exc}"}
    return {"elements": n, "results": out}


@part("params")
def params():
    """The outer round's host copies: every parameter read into one flat fp32 CPU vector and
    written back, through runtime.host_transfer's pinned chunks (ParamIO) against plain
    pageable copies, with the results compared."""
    import torch
    from nebula_cli.runtime.params import _DirectIO
    dev = "cpu" if DRY else "cuda"
    count, each = (8, 1 << 16) if DRY else (64, 1 << 22)  # 1 GiB of fp32 on the GPU
    ps = [torch.nn.Parameter(torch.randn(each, device=dev)) for _ in range(count)]
    io = _DirectIO(ps)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def timed(fn):
        fn()  # warm-up (pinned buffers, allocator)
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return out, time.perf_counter() - t0

    def plain_read():
        return torch.cat([p.detach().to("cpu", torch.float32).reshape(-1) for p in ps])

    def plain_write(flat):
        for i, p in enumerate(ps):
            p.data.copy_(flat.narrow(0, i * each, each))

    ref, t_plain_read = timed(plain_read)
    got, t_read = timed(io.read)
    target = ref + 1.0
    _, t_plain_write = timed(lambda: plain_write(target))
    plain_ok = bool(torch.equal(plain_read(), target))
    _, t_write = timed(lambda: io.write(ref))
    gb = io.numel * 4 / 1e9
    return {"bytes": io.numel * 4, "read_gbs": round(gb / t_read, 2),
            "plain_read_gbs": round(gb / t_plain_read, 2),
            "write_gbs": round(gb / t_write, 2), "plain_write_gbs": round(gb / t_plain_write, 2),
            "read_speedup": round(t_plain_read / t_read, 2),
            "write_speedup": round(t_plain_write / t_write, 2),
            "read_identical": bool(torch.equal(got, ref)),
            "write_identical": plain_ok and bool(torch.equal(io.read(), ref))}


def launch(name, workdir, run, relay, deepspeed=None):
    """`nebula launch` a two-cluster job (one rank each, local transport) until it ends."""
    spec = {"name": name, "workdir": str(workdir), "run": run, "env": {"OMP_NUM_THREADS": "1"},
            "clusters": [{"name": c, "transport": "local", "hosts": [{"host": h}]}
                         for c, h in (("east", "e1"), ("west", "w1"))],
            "relay": relay}
    if deepspeed:
        spec["deepspeed"] = deepspeed
    path = WORK / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return launch_spec(path)


def launch_spec(path):
    """`nebula launch` the spec at ``path`` until the job ends: (job, its status --json, every
    worker's metric records, wall seconds); a failed launch raises with the job's last logs."""
    home = Path(os.environ["NEBULA_HOME"])
    before = set(p.name for p in (home / "jobs").iterdir()) if (home / "jobs").is_dir() else set()
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "nebula_cli", "launch", str(path)],
                          capture_output=True, text=True, timeout=420, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    job = sorted(set(p.name for p in (home / "jobs").iterdir()) - before)
    if proc.returncode != 0 or len(job) != 1:
        logs = subprocess.run([sys.executable, "-m", "nebula_cli", "logs", job[-1], "-n", "25"],
                              capture_output=True, text=True, timeout=120) if job else None
        raise RuntimeError(f"nebula launch exited {proc.returncode}: "
                           f"{(proc.stdout + proc.stderr)[-1500:]}\nthe job's logs, last lines:\n"
                           f"{(logs.stdout + logs.stderr)[-4000:] if logs else '(no job)'}")
    status = json.loads(subprocess.run([sys.executable, "-m", "nebula_cli", "status", job[0],
                                        "--json"], capture_output=True, text=True,
                                       timeout=120).stdout or "{}")
    records = []
    for f in sorted((home / "jobs" / job[0]).glob("*/*/worker/metrics/*.jsonl")):
        records += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return job[0], status, records, wall


def job_logs(job):
    return subprocess.run([sys.executable, "-m", "nebula_cli", "logs", job], capture_output=True,
                          text=True, timeout=120).stdout


@part("quickstart")
def quickstart():
    cfg = json.loads((REPO / "examples/gpt/ds_config.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 4 if DRY else 16
    (WORK / "ds_config.json").write_text(json.dumps(cfg))
    relay = {"sync": {"mode": "diloco", "inner_steps": H},
             "compression": {"codec": "int8"}, "timeout": 120}
    job, status, records, wall = launch(
        "gpu-check-gpt", REPO / "examples/gpt",
        f"python -u train.py --steps {STEPS} --eval-every {STEPS} --log-every 5"
        + (" --context 32" if DRY else ""),  # the CPU: a quarter of the tokens a step
        relay, deepspeed=str(WORK / "ds_config.json"))
    finals = [r for r in records if r.get("final")]
    rounds = [float(r["round_s"]) for r in records if "round_s" in r]
    if status.get("state") != "SUCCEEDED" or len(finals) != 2:
        raise RuntimeError(f"job {job}: state {status.get('state')}, {len(finals)} final "
                           f"records of 2")
    return {"job": job, "state": status.get("state"), "steps": STEPS, "inner_steps": H,
            "eval_loss": [round(float(r["eval_loss"]), 4) for r in finals],
            "s_per_step": max(float(r["s_per_step"]) for r in finals),
            "identical": len({r["param_sha256"] for r in finals}) == 1,
            "relay_round_s": {"mean": round(sum(rounds) / len(rounds), 4) if rounds else None,
                              "max": round(max(rounds), 4) if rounds else None,
                              "rounds": len(rounds)},
            "wall_s": round(wall, 1)}

@part("distill")
def distill():
    """examples/distill as its nebula.yaml says (phase b), twice: the spec's default labels
    (`labels: sampled`, 12 draws, T 1, alpha 0.9), then the teacher's top 32 (`labels: topk`,
    fp16 values) at the same T and alpha: the built-in example teacher
    (a GPT-2 over the example's 2048-token BPE vocabulary) served on the GPU by one cluster, the
    example student trained on the GPU by another through the label relay (mutual TLS,
    loopback); the teacher's busiest answers per second and mean latency, the student's bytes
    per token, batches without labels, its eval loss and the device both ran on."""
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    examples = WORK / "examples"
    shutil.copytree(REPO / "examples", examples, ignore=shutil.ignore_patterns("out", "teacher"))
    torch.manual_seed(0)
    embd, layers = (64, 2) if DRY else (512, 8)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_positions=64, n_embd=embd,
                                       n_layer=layers, n_head=8))
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(examples / "distill" / "teacher")
    steps = 20 if DRY else 200
    out = {"teacher_params": params, "steps": steps}
    for name, change in (("sampled", {}), ("topk", {"labels": "topk", "topk": 32})):
        spec = yaml.safe_load((examples / "distill" / "nebula.yaml").read_text())
        spec["env"] = {"STEPS": str(steps), "OMP_NUM_THREADS": "1"}
        spec["distill"].update(change)
        path = examples / "distill" / f"gpu-check-{name}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        job, status, records, wall = launch_spec(path)
        logs = job_logs(job)
        evals = [line for line in logs.splitlines() if "eval loss" in line]
        if status.get("state") != "SUCCEEDED" or not evals:
            raise RuntimeError(f"job {job}: state {status.get('state')}; logs:\n{logs[-3000:]}")
        student = status.get("metrics", {}).get("cloud", {})
        # the teacher's figures over its busy intervals (its last record, at its stop, has none)
        busy = [r for r in records if r.get("teacher_latency_ms") is not None]
        served = sum(r["teacher_answers_per_s"] for r in busy) or 1.0
        out[name] = {
            "job": job, "state": status.get("state"), "distill": change or "as nebula.yaml",
            "teacher_answers": status.get("metrics", {}).get("lab", {}).get("teacher_answers"),
            "teacher_busiest_answers_per_s": max((r["teacher_answers_per_s"] for r in busy),
                                                 default=None),
            "teacher_latency_ms": round(sum(r["teacher_latency_ms"] * r["teacher_answers_per_s"]
                                            for r in busy) / served, 1) if busy else None,
            "batches": student.get("distill_batches"),
            "without_labels": student.get("distill_without_labels"),
            "bytes_per_token": student.get("distill_bytes_per_token"),
            "longest_wait_s": student.get("distill_longest_wait_s"),
            "final": evals[-1].split("|", 1)[-1].strip(), "wall_s": round(wall, 1)}
    return out


def job_processes(job):
    """Processes still running with the job's NEBULA_JOB_ID (workers, relays, agents)."""
    mark = f"NEBULA_JOB_ID={job}".encode()
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in env.read_bytes().split(b"\0"):
                found.append(int(env.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found

@part("bad_ask")
def bad_ask():
    """Issue 48 item 2 on CUDA: a teacher's serving rank (`ServeLink`, the built-in server's
    answerer around a GPT-2 on the GPU) given asks its model cannot run (an id at its
    vocabulary, sequences past its positions) fails those asks alone, before the model sees
    them (no device-side assert), and answers a good ask after them on the same device."""
    import ssl

    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from nebula_cli.config.distill_spec import DistillSpec
    from nebula_cli.relay.distill.idpack import bits_needed, pack_ids
    from nebula_cli.relay.distill.messages import LabelAsk
    from nebula_cli.relay.distill.serve_link import AskFailed, ServeLink
    from nebula_cli.relay.distill.sparse import Values
    from nebula_cli.runtime.distill.serve import answerer

    device = torch.device("cpu" if DRY else "cuda")
    vocab, positions = 2048, 64
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=64,
                                       n_layer=2, n_head=4)).to(device).eval()
    d = DistillSpec()
    cfg = type("Cfg", (), {"values": d.values, "topk": 8, "temperature": d.temperature})
    link = ServeLink("127.0.0.1:1", ssl.create_default_context(), job_id="gpu-check",
                     cluster="lab", vocab=vocab, context=positions,
                     answer=answerer(lambda ids: model(ids).logits, cfg, device))

    def ask(ids):
        ids = np.asarray(ids)
        bits = bits_needed(ids)
        a = LabelAsk(seq=0, tokens=ids.size, width=ids.shape[-1], bits=bits)
        return link._answer(a, pack_ids(ids.reshape(-1), bits), Values(d.values))

    failed = []
    for bad in ([[1, vocab]], np.zeros((1, positions + 1), dtype=np.int64)):
        try:
            ask(bad)
        except AskFailed as exc:
            failed.append(str(exc))
    good = ask([[1, 2, 3]])
    torch.cuda.synchronize() if not DRY else None
    if len(failed) != 2 or good.type.name != "LABELS":
        raise RuntimeError(f"failed {failed}, then {good.type.name}")
    return {"device": str(device), "failed": failed, "then": good.type.name}


@part("hook")
def hook():
    relay = {"sync": {"mode": "diloco", "inner_steps": H}, "compression": {"codec": "int8"},
             "timeout": 120}
    steps = STEPS + 1  # not a multiple of H: the hook's last round at exit
    job, status, records, wall = launch("gpu-check-hook", REPO / "examples/ds_plain",
                                        f"python -u train.py --steps {steps}", relay)
    if status.get("state") != "SUCCEEDED":
        raise RuntimeError(f"job {job}: state {status.get('state')}")
    return {"job": job, "state": status.get("state"), "steps": steps,
            "records": len(records), "processes_left": len(job_processes(job)),
            "wall_s": round(wall, 1)}



result["ok"] = not result["errors"] and (result["parts"].get("hook") or {}).get(
    "processes_left", 1) == 0
print(json.dumps(result), flush=True)
if os.environ.get("GPU_CHECK_OUT"):
    Path(os.environ["GPU_CHECK_OUT"]).write_text(json.dumps(result) + "\n")
sys.exit(0 if result["ok"] else 1)
PYTHON
