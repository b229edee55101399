"""Phase b, the teacher's site: serve the pre-trained teacher's soft labels to the students
(a teacher cluster's `run:`). Any model works the same way: `serve` takes a function from
token ids (sequences, width) to logits (sequences, width, vocab). On this rank's GPU when
there is one."""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM

from nebula_cli.runtime.distill import serve

if __name__ == "__main__":
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if torch.cuda.is_available() else torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else
                                                 "teacher").to(device).eval()
    serve(lambda ids: model(ids).logits, device=device)
