"""The built-in teacher server (`python -m nebula_cli.runtime.distill.hf_server`): a Hugging
Face causal LM directory (a teacher cluster's `teacher: {model: ...}`) served with `serve`,
on this rank's GPU when there is one, ``batch_tokens`` tokens through the model at a time."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import torch

from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV, DistillConfig
from nebula_cli.config.distill_spec import TeacherSpec
from nebula_cli.config.hf_model import positions_of
from nebula_cli.runtime.distill.serve import serve

OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
"""Set for a model directory (not `teacher.hub`), before transformers is imported: a missing
directory is not taken for a hub id and retried as a download."""


def local_model(cfg: DistillConfig) -> str:
    """The model directory of a teacher whose `model` is no hub id, the hub switched off for
    this process; SystemExit naming the host, the path and the fixes if it holds no model."""
    assert cfg.model is not None
    for name in OFFLINE_ENV:
        os.environ[name] = "1"
    path = Path(cfg.model).expanduser()
    if not (path / "config.json").is_file():
        where = path if path.is_absolute() else f"{path} in {Path.cwd()}"
        why = ("no config.json in it" if path.is_dir() else
               "a file, not a directory" if path.exists() else "no such directory")
        raise SystemExit(
            f"cluster {cfg.cluster} on {socket.gethostname()}: no Hugging Face model at "
            f"{where} ({why}); "
            "the spec's teacher.model is a directory on the teacher's hosts, relative to the "
            "workdir: save one there with model.save_pretrained(...), or set "
            "`teacher: {hub: true}` to download a hub id")
    return str(path)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = DistillConfig.load(os.environ[DISTILL_CONFIG_ENV])
    if cfg.model is None:
        raise SystemExit(f"cluster {cfg.cluster}: distill.json names no model (the spec's "
                         "`teacher: {model: <directory>}`)")
    model_path = cfg.model if cfg.hub else local_model(cfg)
    from transformers import AutoModelForCausalLM

    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if torch.cuda.is_available() else torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(model_path).to(device).eval()
    rows_at_once = cfg.batch_tokens or TeacherSpec.model_fields["batch_tokens"].default

    def forward(ids: torch.Tensor) -> torch.Tensor:
        step = max(1, rows_at_once // ids.shape[1])
        return torch.cat([model(ids[i:i + step]).logits for i in range(0, len(ids), step)])

    positions = positions_of(model.config.to_dict())
    serve(forward, context=positions, config=cfg, device=device)  # vocab: its logits'


if __name__ == "__main__":
    main()
