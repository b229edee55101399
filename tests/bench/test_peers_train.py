"""bench/_peers_train.py: the peers' inner optimizer steps with the lr a DeepSpeed engine gives
each step under examples/gpt/ds_config.json's WarmupLR (read off a real engine in a process of
its own), not one step ahead of it: that step made the peers' loss at equal tokens 0.4 % lower
in bench/peers.py on 2026-11-27 and 2026-11-29."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from helpers.bench_modules import load_bench
from helpers.jobs import REPO
from helpers.sshd_bed import free_port

STEPS = 34  # past the 30 warmup steps

ENGINE = r"""
import json, os, sys
import torch, deepspeed
config = json.load(open(sys.argv[1]))
config["train_micro_batch_size_per_gpu"] = 1
model = torch.nn.Linear(2, 1)
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config)
lrs = []
for _ in range(int(sys.argv[2])):
    engine.backward(engine(torch.ones(1, 2)).sum())
    lrs.append(optimizer.param_groups[0]["lr"])  # the lr this optimizer step applies
    engine.step()
print(json.dumps(lrs))
"""


def deepspeed_lrs() -> list[float]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "PATH": "/usr/bin:/bin",
           "CUDA_VISIBLE_DEVICES": ""}  # the CPU engine, on a GPU machine too
    proc = subprocess.run([sys.executable, "-c", ENGINE,
                           str(REPO / "examples" / "gpt" / "ds_config.json"), str(STEPS)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_peers_warmup_gives_every_step_deepspeeds_lr() -> None:
    train = load_bench("_peers_train")
    model = torch.nn.Linear(2, 1)
    optimizer = train.adamw(model.parameters())
    schedule = train.warmup(optimizer)
    peers = []
    for _ in range(STEPS):
        peers.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    engine = deepspeed_lrs()
    assert engine[:3] == [0.0, 0.0, 0.002 / 30]  # DeepSpeed's: nothing learned in two steps
    assert peers == engine
    assert [train.warmup_factor(s) * 0.002 for s in range(1, STEPS + 1)] == engine
