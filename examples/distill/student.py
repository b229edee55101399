"""Phase b, the students' site: a smaller GPT-2 trained on the BPE-tokenized corpus from the
teacher's sparse soft labels (`soft_labelled` asks `lookahead` batches ahead; `kd_loss` mixes
KL at temperature T on the top k with the hard labels), as a cluster's `run:`, on this rank's
GPU when there is one."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from bpe import sequences, token_split, train_tokenizer
from transformers import GPT2Config, GPT2LMHeadModel

from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV, DistillConfig
from nebula_cli.runtime.distill import kd_loss, soft_labelled

WIDTH, BATCH, STEPS = 64, 8, int(os.environ.get("STEPS", "200"))

if __name__ == "__main__":
    cfg = DistillConfig.load(os.environ[DISTILL_CONFIG_ENV])
    # the job's own folder on this host (set by nebula's agent), not the user's checkout
    tok = train_tokenizer(Path(os.environ.get("NEBULA_AGENT_DIR", "out")) / "bpe.json")
    train, held = token_split(tok)
    seqs = sequences(train, WIDTH)
    batches = [seqs[(i * BATCH) % (len(seqs) - BATCH):][:BATCH] for i in range(STEPS)]
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if torch.cuda.is_available() else torch.device("cpu"))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=WIDTH,
                                       n_embd=64, n_layer=2, n_head=2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = soft_labelled(batches, config=cfg)
    for step, (batch, soft) in enumerate(loader):
        batch = batch.to(device)
        loss, kd, ce = kd_loss(model(batch).logits, batch, soft, temperature=cfg.temperature,
                               alpha=cfg.alpha)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.3f} kd {kd and kd.item()} "
                  f"without labels {loader.stats.without_labels}", flush=True)
    with torch.no_grad():
        ev = sequences(held, WIDTH)[:32].to(device)
        print(f"eval loss {model(ev, labels=ev).loss.item():.4f}; "
              f"{loader.stats.bytes_per_token:.1f} bytes per token; on {device}", flush=True)
    loader.client.close()
