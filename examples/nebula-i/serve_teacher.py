"""Phase b's teacher: the GPT phase a pre-trained (examples/gpt/model.py, the sizes phase a
used), rebuilt here and loaded from phase a's newest checkpoint, which nebula copied to this
host (`teacher: {from_job: ...}`: ``NEBULA_TEACHER_CHECKPOINT`` names it), then served to the
students (`runtime.distill.serve`), on this rank's GPU when there is one.

    python -u nebula-i/serve_teacher.py [--d-model 128 --n-layer 4 --n-head 4 --context 128]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt"))
from model import GPT, GPTConfig  # noqa: E402

from nebula_cli.runtime.distill import serve  # noqa: E402
from nebula_cli.runtime.distill.teacher_checkpoint import load_state_dict  # noqa: E402

if __name__ == "__main__":
    defaults = GPTConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=defaults.d_model)
    p.add_argument("--n-layer", type=int, default=defaults.n_layer)
    p.add_argument("--n-head", type=int, default=defaults.n_head)
    p.add_argument("--context", type=int, default=defaults.block_size)
    args = p.parse_args()
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if torch.cuda.is_available() else torch.device("cpu"))
    model = GPT(GPTConfig(block_size=args.context, n_layer=args.n_layer, n_head=args.n_head,
                          d_model=args.d_model))
    model.load_state_dict({k: v.float() for k, v in load_state_dict().items()})
    model.to(device).eval()
    print(f"teacher: {model.num_params():,} parameters from phase a's checkpoint, on {device}",
          flush=True)
    serve(lambda ids: model(ids)[0], vocab=model.cfg.vocab_size, context=args.context,
          device=device)
