"""What OuterSync's tests (runtime/test_sync.py, runtime/test_sync_deepspeed.py,
runtime/test_cadence.py) share: in-test averagers that return a known average (below the real relay
test of the same path: runtime.sync -> relay.client -> relay server), the small model, and the
outer step written out by hand."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from helpers.plan_defaults import default_sync_config

LR, MU = 0.7, 0.9
"""The outer learning rate and momentum the tests' rounds use."""
CFG = default_sync_config()  # the spec's defaults; each test names what it changes
TRAINABLE = 6 * 8 + 8 + 8 * 3 + 3  # parameters of small_model


@dataclass
class Result:
    """Shape of relay.client.RoundResult."""

    tensor: torch.Tensor
    present: list[str]
    round_id: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    global_state: torch.Tensor | None = None  # set when this cluster was behind


def other_cluster(round_id: int, n: int) -> torch.Tensor:
    """The pretend second cluster's contribution in a round: known, round-dependent."""
    return 1e-3 * (round_id + 1) * torch.linspace(-1.0, 1.0, n)


@dataclass
class TwoClusterAverager:
    """Averages this cluster's tensor with `other_cluster(round_id)`; records what it saw."""

    sent: list[torch.Tensor] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    closed: int = 0

    def allreduce(self, round_id: int, tensor: torch.Tensor, info: Any = None) -> Result:
        self.sent.append(tensor.clone())
        self.rounds.append(round_id)
        avg = 0.5 * (tensor + other_cluster(round_id, tensor.numel()))
        nbytes = tensor.numel() * 4
        return Result(avg, ["a", "b"], round_id, nbytes, nbytes, 0.01)

    def close(self) -> None:
        self.closed += 1


@dataclass
class ScriptedAverager(TwoClusterAverager):
    """Like TwoClusterAverager, but rounds listed in `script` get a relay-made outcome."""

    script: dict[int, Any] = field(default_factory=dict)
    published: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def allreduce(self, round_id: int, tensor: torch.Tensor, info: Any = None) -> Result:
        res = super().allreduce(round_id, tensor)
        return self.script[round_id](tensor) if round_id in self.script else res

    def publish_state(self, round_id: int, tensor: torch.Tensor,
                      momentum: torch.Tensor | None = None) -> None:
        self.published.append((round_id, tensor.clone()))


@dataclass
class LendingAverager(ScriptedAverager):
    """A ScriptedAverager that lends rank 0 the memory it sends from, as the relay client does
    (``contribution_buffer``: one buffer used again every round; ``state_buffer``: new memory
    whose halves are published as they lie), and records whether each round's contribution and
    each published state came in it."""

    in_lent: list[bool] = field(default_factory=list)
    published_in_lent: list[bool] = field(default_factory=list)
    _lent: torch.Tensor | None = None

    def contribution_buffer(self, numel: int) -> torch.Tensor:
        if self._lent is None or self._lent.numel() != numel:
            self._lent = torch.full((numel,), float("nan"))  # what is not written shows
        return self._lent

    def state_buffer(self, numel: int) -> torch.Tensor:
        return torch.full((numel,), float("nan"))

    def allreduce(self, round_id: int, tensor: torch.Tensor, info: Any = None) -> Result:
        self.in_lent.append(self._lent is not None and tensor.data_ptr() == self._lent.data_ptr())
        return super().allreduce(round_id, tensor, info)

    def publish_state(self, round_id: int, tensor: torch.Tensor,
                      momentum: torch.Tensor | None = None) -> None:
        self.published_in_lent.append(momentum is not None and momentum.data_ptr() ==
                                      tensor.data_ptr() + 4 * tensor.numel())
        super().publish_state(round_id, tensor, momentum)


def expected_avg(sent: torch.Tensor, round_id: int) -> torch.Tensor:
    return 0.5 * (sent.double() + other_cluster(round_id, sent.numel()).double())


def nesterov(theta: torch.Tensor, v: torch.Tensor | None, g: torch.Tensor):
    """Reference outer step in float64, written out by hand."""
    theta, g = theta.double(), g.double()
    v = g.clone() if v is None else MU * v + g
    return theta - LR * (g + MU * v), v


def few_trainable_model() -> torch.nn.Module:
    """small_model with one trainable tensor of 3 values left (a LoRA-like job's handful): on 4
    ranks each of the first three owns one value and the last an empty shard."""
    model = small_model()
    for p in model.parameters():
        p.requires_grad_(False)
    model[2].bias.requires_grad_(True)
    return model


def small_model(freeze_first: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if freeze_first:
        for p in model[0].parameters():
            p.requires_grad_(False)
    return model


def overlap_expectations(theta0: torch.Tensor, locals_: list[torch.Tensor],
                         sent: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(theta_global, params) after each overlapped boundary, by hand: the average of round
    k is applied once, at boundary k+1, and the params keep the cluster's own progress."""
    theta, v, anchor = theta0.double(), None, theta0.double()
    out = []
    for k, local in enumerate(locals_):
        delta = anchor - local.double()
        torch.testing.assert_close(sent[k].double(), delta, rtol=0, atol=1e-6)
        if k == 0:
            anchor = local.double()
        else:
            theta, v = nesterov(theta, v, expected_avg(sent[k - 1], k - 1))
            anchor = theta - delta
        out.append((theta.clone(), anchor.clone()))
    theta, v = nesterov(theta, v, expected_avg(sent[-1], len(sent) - 1))  # flush
    out.append((theta, theta))
    return out


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    opt.step()
