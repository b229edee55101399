"""Phase b, the teacher's site: serve the pre-trained teacher's soft labels to the students
(a teacher cluster's `run:`). Any model works the same way: `serve` takes a function from
token ids (sequences, width) to logits (sequences, width, vocab). On this rank's GPU when
there is one."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "teacher"
    if not os.path.isfile(os.path.join(path, "config.json")):  # not a hub id: say it now
        sys.exit(f"no teacher model at {os.path.abspath(path)} on {os.uname().nodename}: save "
                 "the pre-trained model there with model.save_pretrained(...) (README, "
                 "'Distillation across sites')")
    os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers: a local folder, never the hub

    import torch
    from transformers import AutoModelForCausalLM

    from nebula_cli.runtime.distill import serve

    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if torch.cuda.is_available() else torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    serve(lambda ids: model(ids).logits, device=device)
