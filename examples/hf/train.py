"""A Hugging Face Trainer script as people write them: no nebula import.

A small GPT-2 built from a config (no weights are downloaded) learns bytes of text that is on
every machine (the source of a few modules of Python's standard library, PSF licence). The
Trainer reaches DeepSpeed through accelerate, which calls `deepspeed.initialize`; under
`nebula launch` nebula's automatic hook wraps that call, so the clusters average their progress
every `inner_steps` optimizer steps and end with one model.

With ``--lora R`` the model gets peft LoRA adapters of rank R and only they train: only they
travel between the clusters (examples/lora).

    nebula launch nebula.yaml                                 # two clusters on this machine
    deepspeed train.py --steps 60                             # DeepSpeed alone, without nebula
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

HERE = Path(__file__).resolve().parent
CONTEXT = 32


class StdlibBytes(torch.utils.data.Dataset):
    """Windows of CONTEXT bytes of a few standard-library modules' source."""

    def __init__(self, start: int, count: int) -> None:
        import argparse as a
        import textwrap as t
        import typing as y

        text = b"".join(Path(m.__file__).read_bytes() for m in (a, t, y))
        self.data = torch.tensor(list(text), dtype=torch.long)
        self.start, self.count = start, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        at = (self.start + i * 97) % (len(self.data) - CONTEXT)
        window = self.data[at:at + CONTEXT]
        return {"input_ids": window, "labels": window}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ds-config", default=str(HERE / "ds_config.json"))
    p.add_argument("--output-dir", default="hf-out")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: train the whole model)")
    p.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it
    args = p.parse_args()
    torch.manual_seed(1234)  # the same initial weights everywhere
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64,
                                       n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora,
                                                 target_modules=["c_attn", "c_proj"],
                                                 fan_in_fan_out=True))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"parameters: {trainable} trainable of {total}", flush=True)
    with open(args.ds_config) as f:
        ds_config = json.load(f)
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8,
        learning_rate=2e-3, logging_steps=10, deepspeed=ds_config, report_to=[],
        save_strategy="no", use_cpu=not torch.cuda.is_available(), seed=1234)
    trainer = Trainer(model=model, args=training, train_dataset=StdlibBytes(0, 100_000),
                      eval_dataset=StdlibBytes(50_000, 64))
    trainer.train()
    print(f"eval loss {trainer.evaluate()['eval_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
