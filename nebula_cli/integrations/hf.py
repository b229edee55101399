"""nebula in a Hugging Face Trainer, said in code:

    from nebula_cli.integrations.hf import NebulaCallback
    trainer = Trainer(..., callbacks=[NebulaCallback()])   # with --deepspeed / deepspeed=...

For a job whose spec sets ``runtime: {auto: false}`` (with the default ``auto: true`` the
automatic hook does the same for an unmodified script, and this callback changes nothing).
It turns on the same engine wrapper as the hook (`nebula_cli.runtime.hook`): the DeepSpeed
engine the Trainer builds (through accelerate's ``deepspeed.initialize``) joins the clusters'
outer sync, records its loss, step rate and checkpoints as the spec says; when training ends
(``on_train_end``) the last outer round runs while the ranks can still talk, so every worker
of every cluster ends with the same parameters before ``evaluate`` or ``save_model``.

Outside a nebula job (no NEBULA_JOB_ID) it does nothing: the script runs as it would without
it. Needs the ``hf`` extra (transformers); nebula's own dependencies do not include it.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from nebula_cli.runtime import hook


class NebulaCallback(TrainerCallback):  # type: ignore[misc]
    """Join the job's cross-cluster sync (make it before ``trainer.train()``)."""

    def __init__(self) -> None:
        if os.environ.get("NEBULA_JOB_ID"):  # outside a nebula job: nothing to join
            hook.install()  # before the Trainer builds its engine in train()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        hook.finish_training("trainer end")
