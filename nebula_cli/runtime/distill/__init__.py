"""Distillation in a training (student) or teacher process: the small API a script uses.

Student side::

    from nebula_cli.runtime import distill
    loader = distill.soft_labelled(loader)          # or DistillLoader(loader, ...)
    for batch, soft in loader:                      # soft: SoftLabels, or None (ce_only)
        logits = model(batch["input_ids"]).logits
        loss = distill.kd_loss(logits, batch["labels"], soft, temperature=..., alpha=...)

Teacher side: ``distill.serve(forward)`` (``forward``: token ids (batch, width) -> logits
(batch, width, vocab)); the built-in server for a Hugging Face causal LM is `hf_server`.
The settings come from the process's distill.json (`config.distill_config`), written by
nebula; tests and benches pass a `DistillConfig` and its certificates themselves.
"""

from nebula_cli.runtime.distill.loader import DistillLoader, SoftLabels, soft_labelled
from nebula_cli.runtime.distill.loss import kd_loss, topk_labels
from nebula_cli.runtime.distill.serve import serve

__all__ = ["DistillLoader", "SoftLabels", "kd_loss", "serve", "soft_labelled", "topk_labels"]
