"""A plain DeepSpeed training script, as a user would write it: no nebula import.

A small byte-level language model (the previous CONTEXT bytes predict the next one) trained on
text that is on every machine: the source of a few modules of Python's standard library (PSF
licence). The script knows nothing of clusters: under `nebula launch` (runtime.auto, the
default) nebula's automatic hook wraps `deepspeed.initialize`, syncs the engine with the other
clusters every `inner_steps` optimizer steps and records loss, steps/s and samples/s.

    nebula launch nebula.yaml                       # two clusters on this machine
    deepspeed --num_gpus 2 train.py --steps 300     # DeepSpeed alone, without nebula
"""

import argparse
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
CONTEXT = 8


def corpus() -> torch.Tensor:
    """The source of a few standard-library modules, as bytes."""
    import argparse as a
    import textwrap as t
    import typing as y

    text = b"".join(Path(m.__file__).read_bytes() for m in (a, t, y))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


class ByteModel(torch.nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(CONTEXT * dim, hidden), torch.nn.GELU(),
                                       torch.nn.Linear(hidden, 256))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.mlp(self.embed(x).flatten(1))
        return torch.nn.functional.cross_entropy(logits, y)


def batch(data: torch.Tensor, size: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    starts = torch.randint(0, len(data) - CONTEXT - 1, (size,), generator=gen)
    x = torch.stack([data[s:s + CONTEXT] for s in starts.tolist()])
    return x, data[starts + CONTEXT]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--ds-config", default=str(HERE / "ds_config.json"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it
    args = p.parse_args()

    torch.manual_seed(args.seed)  # the same initial weights everywhere
    model = ByteModel()
    with open(args.ds_config) as f:
        config = json.load(f)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    rank = dist.get_rank()
    gen = torch.Generator()
    gen.seed()  # each process draws its own batches
    data = corpus()
    accum = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(1, args.steps + 1):
        for _ in range(accum):
            x, y = (t.to(engine.device) for t in batch(data, micro, gen))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
