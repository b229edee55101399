"""Muon for the GPT's weight matrices, AdamW for the rest, as one optimizer (``train.py
--optimizer muon``; bench/diloco_schedule.py ``--optimizer muon``).

Muon (Keller Jordan, 2024; torch's own ``torch.optim.Muon``) orthogonalises each 2-D weight's
momentum with Newton-Schulz iterations; it takes matrices only, and the embeddings, the head,
the norms and the biases stay on AdamW, as its authors and Moonshot's "Muon is Scalable" run it.
MuLoCo (2025) found DiLoCo's pseudo-gradients of Muon inner steps quantise to 2 bits at almost
no loss. ``deepspeed.initialize`` takes one optimizer, so the two are one class here; their
param groups are this optimizer's (a learning-rate scheduler's change reaches both). Muon's
rate is matched to AdamW's RMS (``adjust_lr_fn="match_rms_adamw"``), so both take the same lr
and weight decay.

ZeRO 1-3 partition the parameters into flat fp32 buffers, where no matrix is left for Muon:
``train.py`` refuses Muon with ZeRO above 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

MUON_MOMENTUM = 0.95
"""Muon's momentum (torch's default, and Moonshot's)."""
ADAMW, MUON = "adamw", "muon"
OPTIMIZERS = (ADAMW, MUON)
"""What ``--optimizer`` takes: the DeepSpeed config's AdamW, or Muon with AdamW."""
ADAMW_SETTINGS = ("lr", "betas", "eps", "weight_decay")
"""The AdamW settings of a DeepSpeed config's optimizer that both parts take."""


def muon_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the hidden weight matrices Muon takes, every other trainable parameter): matrices of
    the blocks; embeddings and the head stay on AdamW (their rows are tokens, not features)."""
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        inner = name.startswith("blocks.") and p.ndim == 2
        (matrices if inner else rest).append(p)
    return matrices, rest


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on `matrices`, ``torch.optim.AdamW`` on `rest`, stepped together."""

    def __init__(self, matrices: Iterable[nn.Parameter], rest: Iterable[nn.Parameter], *,
                 lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, momentum: float = MUON_MOMENTUM) -> None:
        self.muon = torch.optim.Muon(list(matrices), lr=lr, weight_decay=weight_decay,
                                     momentum=momentum, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(list(rest), lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay)
        self._parts = (self.muon, self.adamw)
        # the same group dicts as the two parts' (add_param_group keeps each dict it is given):
        # a scheduler's lr reaches them
        super().__init__([g for part in self._parts for g in part.param_groups], {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self._parts:
            part.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


def muon_adamw(model: nn.Module, adamw: dict[str, Any]) -> MuonAdamW:
    """Muon with AdamW for `model`, at the AdamW settings `adamw` (a DeepSpeed config's
    optimizer params: lr, and any of betas, eps, weight_decay; the others left at
    MuonAdamW's)."""
    matrices, rest = muon_parameters(model)
    given = {k: tuple(v) if k == "betas" else v for k, v in adamw.items() if k in ADAMW_SETTINGS}
    return MuonAdamW(matrices, rest, **given)
