"""Phase b, the teacher's site: serve the pre-trained teacher's soft labels to the students
(a teacher cluster's `run:`). Any model works the same way: `serve` takes a function from
token ids (sequences, width) to logits (sequences, width, vocab)."""

from __future__ import annotations

import sys

from transformers import AutoModelForCausalLM

from nebula_cli.runtime.distill import serve

if __name__ == "__main__":
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else
                                                 "teacher").eval()
    serve(lambda ids: model(ids).logits)
