"""The outer optimizer of DiLoCo (SGD with Nesterov momentum on theta_global) and the error
every part of the runtime's sync raises."""

from __future__ import annotations

import math
from typing import Any

import torch

from nebula_cli.errors import NebulaError

STEP_CHUNK = 1 << 22
"""Elements of the outer step's update formed at a time (16 MiB of fp32)."""


class SyncError(NebulaError):
    """The outer synchronisation cannot be set up for this engine, or a round failed."""


class OuterOptimizer:
    """SGD with (Nesterov) momentum on ``theta_global``; the averaged delta is its gradient.

    ``v = mu * v + g``; ``theta -= lr * (g + mu * v)`` with Nesterov, else ``theta -= lr * v``.
    """

    def __init__(self, lr: float, momentum: float, nesterov: bool) -> None:
        if not (math.isfinite(lr) and lr > 0):
            raise SyncError(f"outer learning rate must be a positive number, got {lr!r}")
        if not (math.isfinite(momentum) and 0 <= momentum < 1):
            raise SyncError(f"outer momentum must be in [0, 1), got {momentum!r}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.momentum_buffer: torch.Tensor | None = None

    def step(self, theta: torch.Tensor, grad: torch.Tensor) -> None:
        """Update ``theta`` in place with ``grad`` (both flat fp32 of the same size)."""
        if grad.shape != theta.shape:
            raise SyncError(f"outer gradient has {grad.numel()} elements, expected {theta.numel()}")
        grad = grad.to(dtype=theta.dtype, device=theta.device)
        if self.momentum_buffer is None:
            self.momentum_buffer = torch.zeros_like(theta)
        v = self.momentum_buffer
        v.mul_(self.momentum).add_(grad)
        if not self.nesterov:
            theta.add_(v, alpha=-self.lr)
            return
        # theta -= lr * (g + mu * v), as torch's SGD rounds it, a chunk at a time: the update
        # vector never exists whole
        for at in range(0, theta.numel(), STEP_CHUNK):
            n = min(STEP_CHUNK, theta.numel() - at)
            update = grad.narrow(0, at, n).add(v.narrow(0, at, n), alpha=self.momentum)
            theta.narrow(0, at, n).add_(update, alpha=-self.lr)

    def state_dict(self, with_buffer: bool = True) -> dict[str, Any]:
        """The settings and a copy of the momentum (None ``with_buffer=False``)."""
        buf = (None if self.momentum_buffer is None or not with_buffer
               else self.momentum_buffer.clone())
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov,
                "momentum_buffer": buf}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buf = state.get("momentum_buffer")
        self.momentum_buffer = None if buf is None else buf.detach().to(torch.float32).clone()
