"""The built-in teacher server (`python -m nebula_cli.runtime.distill.hf_server`): a Hugging
Face causal LM directory (a teacher cluster's `teacher: {model: ...}`) served with `serve`,
on this rank's GPU when there is one, ``batch_tokens`` tokens through the model at a time."""

from __future__ import annotations

import logging
import os

import torch

from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV, DistillConfig
from nebula_cli.runtime.distill.serve import serve


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = DistillConfig.load(os.environ[DISTILL_CONFIG_ENV])
    if cfg.model is None:
        raise SystemExit(f"cluster {cfg.cluster}: distill.json names no model (the spec's "
                         "`teacher: {model: <directory>}`)")
    from transformers import AutoModelForCausalLM

    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if torch.cuda.is_available() else torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(cfg.model).to(device).eval()
    rows_at_once = cfg.batch_tokens or 16384

    def forward(ids: torch.Tensor) -> torch.Tensor:
        step = max(1, rows_at_once // ids.shape[1])
        return torch.cat([model(ids[i:i + step]).logits for i in range(0, len(ids), step)])

    positions = getattr(model.config, "max_position_embeddings", None) or getattr(
        model.config, "n_positions", None)
    serve(forward, context=positions, config=cfg, device=device)  # vocab: its logits'


if __name__ == "__main__":
    main()
