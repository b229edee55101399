"""Distillation in a training (student) or teacher process: the small API a script uses.

Student side::

    from nebula_cli.runtime import distill
    loader = distill.soft_labelled(loader)          # or DistillLoader(loader, ...)
    for batch, soft in loader:                      # soft: SoftLabels, or None (ce_only)
        logits = model(batch["input_ids"]).logits
        loss = distill.kd_loss(logits, batch["labels"], soft, temperature=..., alpha=...)

On-policy (``distill.mode: on_policy``): ``distill.on_policy(prompts, sample=fn)`` yields the
student's own samples (`Sampled`) with the teacher's scores of them, for `on_policy_loss`
(`runtime.distill.on_policy`).

Teacher side: ``distill.serve(forward)`` (``forward``: token ids (batch, width) -> logits
(batch, width, vocab)); the built-in server for a Hugging Face causal LM is `hf_server`.
The settings come from the process's distill.json (`config.distill_config`), written by
nebula; tests and benches pass a `DistillConfig` and its certificates themselves.
"""

from nebula_cli.runtime.distill.loader import DistillLoader, SoftLabels, soft_labelled
from nebula_cli.runtime.distill.loss import kd_loss, on_policy_loss, topk_labels
from nebula_cli.runtime.distill.on_policy import Sampled, on_policy
from nebula_cli.runtime.distill.serve import serve

__all__ = ["DistillLoader", "Sampled", "SoftLabels", "kd_loss", "on_policy", "on_policy_loss",
           "serve", "soft_labelled", "topk_labels"]
