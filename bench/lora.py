"""Parameter-efficient training across clusters: WAN bytes per outer round with LoRA adapters
next to full-model sync, measured in one invocation on this machine (local transport).

    .venv/bin/python bench/lora.py [--json] [--steps 60] [--rank 8]

Both runs launch examples/hf/train.py (an unmodified Hugging Face Trainer script, a small GPT-2
built from a config) on two clusters joined by their relays (DiLoCo every 10 steps, int8), once
training the whole model and once with peft LoRA adapters of --rank (only they train, so only
they travel). Printed: trainable parameters, WAN bytes each cluster sends per outer round, their
ratio next to the ratio of trainable parameters, rounds, identical parameters at the end, and
the eval loss of each run (the script's own evaluate(); the LoRA run adapts a base model that
is itself random here, so its loss is not the point). Needs the `hf` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "hf"


def run(home: Path, name: str, steps: int, lora: int) -> dict[str, Any]:
    spec = yaml.safe_load((EXAMPLE / "nebula.yaml").read_text())
    spec.update(name=name, workdir=str(EXAMPLE),
                run=f"python -u train.py --steps {steps} --lora {lora} --output-dir "
                    f"{home / name}")
    path = home / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "NEBULA_HOME": str(home), "COLUMNS": "200", "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "nebula_cli", "launch", str(path)], env=env,
                          capture_output=True, text=True, timeout=1200, cwd=REPO,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    (job,) = [p for p in (home / "jobs").iterdir() if p.name.startswith(f"{name}-")]
    recs = [json.loads(line) for p in job.glob("*/*/worker/metrics/*.jsonl")
            for line in p.read_text().splitlines() if line]
    rounds = [r for r in recs if r.get("outer_round") is not None and r.get("cluster") == "east"]
    log = (job / "east" / "e1" / "worker" / "logs" / "rank0.log").read_text()
    trainable, total = map(int, re.search(r"parameters: (\d+) trainable of (\d+)", log).groups())
    finals = {r["param_sha256"] for r in recs if r.get("final")}
    return {"trainable_params": trainable, "total_params": total, "rounds": len(rounds),
            "wan_bytes_per_round": max(r["wan_bytes_sent"] for r in rounds),
            "params_identical": len(finals) == 1,
            "eval_loss": float(re.search(r"eval loss ([0-9.]+)", log).group(1))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="nebula-bench-lora-") as tmp:
        full = run(Path(tmp), "full", args.steps, 0)
        lora = run(Path(tmp), "lora", args.steps, args.rank)
    result = {"steps": args.steps, "lora_rank": args.rank, "full": full, "lora": lora,
              "bytes_ratio": full["wan_bytes_per_round"] / lora["wan_bytes_per_round"],
              "params_ratio": full["trainable_params"] / lora["trainable_params"]}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'':<6}{'trainable':>12}{'WAN B/round':>14}{'rounds':>8}{'identical':>11}"
          f"{'eval loss':>11}")
    for name in ("full", "lora"):
        r = result[name]
        print(f"{name:<6}{r['trainable_params']:>12}{r['wan_bytes_per_round']:>14}"
              f"{r['rounds']:>8}{str(r['params_identical']):>11}{r['eval_loss']:>11.4f}")
    print(f"bytes_ratio (full / lora) {result['bytes_ratio']:.2f}  params_ratio "
          f"{result['params_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
