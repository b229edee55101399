"""OuterSync: the outer optimizer's arithmetic, the round logic on a plain module, and real
DeepSpeed engines (2 CPU ranks over gloo) in every supported ZeRO stage and precision.

The averagers here are in-test stand-ins that return a known average; they sit below the real
relay test of the same path (runtime.sync -> relay.client -> relay server), which comes later.
"""

from __future__ import annotations

import copy
import faulthandler
import os
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from plan_defaults import default_sync_config

from nebula_cli.agent.leftovers import remove_shm_buffers
from nebula_cli.config import strict
from nebula_cli.runtime.sync import OuterOptimizer, OuterSync, SyncError

LR, MU = 0.7, 0.9
CFG = default_sync_config()  # the spec's defaults; each test names what it changes


# --- in-test averagers --------------------------------------------------------------------


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


def expected_avg(sent: torch.Tensor, round_id: int) -> torch.Tensor:
    return 0.5 * (sent.double() + other_cluster(round_id, sent.numel()).double())


def nesterov(theta: torch.Tensor, v: torch.Tensor | None, g: torch.Tensor):
    """Reference outer step in float64, written out by hand."""
    theta, g = theta.double(), g.double()
    v = g.clone() if v is None else MU * v + g
    return theta - LR * (g + MU * v), v


# --- OuterOptimizer on plain tensors --------------------------------------------------------


@pytest.mark.parametrize("nesterov_on", [True, False])
def test_outer_optimizer_matches_torch_sgd_and_hand_formula(nesterov_on: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(257, generator=gen)
    ref = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([ref], lr=LR, momentum=MU, nesterov=nesterov_on)
    outer = OuterOptimizer(LR, MU, nesterov=nesterov_on)
    hand, v = theta.double(), torch.zeros(257, dtype=torch.float64)
    for _ in range(5):
        g = torch.randn(257, generator=gen)
        outer.step(theta, g)
        ref.grad = g.clone()
        sgd.step()
        v = MU * v + g.double()
        hand = hand - LR * ((g.double() + MU * v) if nesterov_on else v)
        torch.testing.assert_close(theta, ref.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(theta.double(), hand, rtol=0, atol=1e-5)


def test_outer_optimizer_first_step_and_state_round_trip() -> None:
    theta = torch.tensor([1.0, -2.0, 0.5])
    g = torch.tensor([0.1, 0.2, -0.4])
    outer = OuterOptimizer(LR, MU, CFG.nesterov)
    outer.step(theta, g)
    # v = g; theta -= lr * (g + mu * g)
    torch.testing.assert_close(theta, torch.tensor([1.0, -2.0, 0.5]) - LR * 1.9 * g)
    saved = outer.state_dict()
    clone = OuterOptimizer(LR, MU, CFG.nesterov)
    clone.load_state_dict(saved)
    a, b = theta.clone(), theta.clone()
    outer.step(a, g)
    clone.step(b, g)
    assert torch.equal(a, b)
    assert not torch.equal(saved["momentum_buffer"], outer.momentum_buffer)  # a copy was saved


@pytest.mark.parametrize("kwargs", [{"lr": 0.0}, {"lr": float("nan")}, {"momentum": 1.0},
                                    {"momentum": -0.1}])
def test_outer_optimizer_rejects_bad_hyperparameters(kwargs: dict) -> None:
    with pytest.raises(SyncError):
        OuterOptimizer(**{"lr": LR, "momentum": MU, "nesterov": True, **kwargs})


# --- OuterSync on a plain module (no DeepSpeed, no torch.distributed) -------------------------


def small_model(freeze_first: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if freeze_first:
        for p in model[0].parameters():
            p.requires_grad_(False)
    return model


def flat(model: torch.nn.Module, trainable_only: bool = True) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()
                      if p.requires_grad or not trainable_only])


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    opt.step()


def test_plain_rounds_apply_nesterov_and_sync_only_trainable_params() -> None:
    model = small_model(freeze_first=True)
    frozen = flat(model[0], trainable_only=False).clone()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    averager = TwoClusterAverager()
    sync = OuterSync(model, config=CFG, averager=averager, inner_steps=3,
                     outer_lr=LR, outer_momentum=MU,
                     mode="diloco", overlap=False)
    assert sync.param_names == ["2.weight", "2.bias"]
    theta, v = flat(model).double(), None
    results = []
    for step in range(1, 7):
        plain_step(model, opt, step)
        if step % 3 == 0:
            local = flat(model).clone()
        out = sync.after_step(step)
        if step % 3:
            assert out is None
            continue
        results.append(out)
        sent = averager.sent[-1]
        assert sent.numel() == 8 * 3 + 3  # the frozen layer does not travel
        torch.testing.assert_close(sent.double(), theta - local.double(), rtol=0, atol=1e-6)
        theta, v = nesterov(theta, v, expected_avg(sent, len(results) - 1))
        torch.testing.assert_close(flat(model).double(), theta, rtol=0, atol=1e-6)
        assert torch.equal(flat(model), sync.theta_global)
    assert averager.rounds == [0, 1]
    assert [r["outer_round"] for r in results] == [0, 1]
    assert results[0]["clusters_present"] == 2 and results[0]["clusters"] == ["a", "b"]
    assert results[0]["wan_bytes_sent"] == 27 * 4 and results[0]["delta_norm"] > 0
    assert torch.equal(flat(model[0], trainable_only=False), frozen)
    sync.close()
    sync.close()
    assert averager.closed == 1
    with pytest.raises(SyncError, match="closed"):
        sync.after_step(7)


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


def test_plain_overlap_applies_each_delayed_average_exactly_once() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = TwoClusterAverager()
    sync = OuterSync(model, config=CFG, averager=averager, inner_steps=2,
                     outer_lr=LR, outer_momentum=MU,
                     mode="diloco", overlap=True,
                     overlap_steps=2)
    theta0 = sync.theta_global.clone()
    locals_, stats, after = [], [], []
    for step in range(1, 7):
        plain_step(model, opt, step)
        if step % 2 == 0:
            locals_.append(flat(model).clone())
        out = sync.after_step(step)
        if out is not None:
            stats.append(out)
            after.append((sync.theta_global.clone(), flat(model).clone()))
    stats.append(sync.flush())
    after.append((sync.theta_global.clone(), flat(model).clone()))
    assert sync.flush() is None  # nothing left in flight
    expected = overlap_expectations(theta0, locals_, averager.sent)
    for (theta, params), (e_theta, e_params) in zip(after, expected, strict=True):
        torch.testing.assert_close(theta.double(), e_theta, rtol=0, atol=1e-6)
        torch.testing.assert_close(params.double(), e_params, rtol=0, atol=1e-6)
    assert averager.rounds == [0, 1, 2]
    assert [s["applied"] for s in stats] == [False, True, True, True]
    assert [s["outer_round"] for s in stats] == [0, 0, 1, 2]
    state = sync.state_dict()
    assert state["round"] == 3 and torch.equal(state["theta_global"], sync.theta_global)
    sync.close()


class SlowAverager(TwoClusterAverager):
    """A round that takes `delay` seconds, like a transfer over a slow link."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def allreduce(self, round_id: int, tensor: torch.Tensor, info: Any = None) -> Result:
        time.sleep(self.delay)
        return super().allreduce(round_id, tensor)


@pytest.mark.parametrize(("overlap_steps", "delay"), [(1, 0.0), (None, 0.0), (None, 0.15)])
def test_plain_overlap_merges_each_average_once_on_top_of_later_progress(
        overlap_steps: int | None, delay: float) -> None:
    """Streaming merge: the average of round k is applied once, some steps after boundary k
    (a fixed count, or as soon as it arrived), and the parameters keep the progress made since
    the boundary; every delta sent is theta_global at its boundary minus the local params."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = SlowAverager(delay)
    sync = OuterSync(model, config=CFG, averager=averager, inner_steps=4,
                     outer_lr=LR, outer_momentum=MU,
                     mode="diloco", overlap=True, overlap_steps=overlap_steps)
    theta, v = sync.theta_global.double().clone(), None
    boundary_local, applied = None, []
    for step in range(1, 13):
        plain_step(model, opt, step)
        before = flat(model).double().clone()
        out = sync.after_step(step)
        if step % 4 == 0:  # a boundary: a delta leaves (after a merge still due, if any)
            if out is not None and out["applied"]:
                theta, v = nesterov(theta, v, expected_avg(averager.sent[len(applied)],
                                                           len(applied)))
                applied.append(step)
                before = theta - (boundary_local - before)
            torch.testing.assert_close(_wait_sent(averager, step // 4).double(),
                                       theta - before, rtol=0, atol=1e-6)
            boundary_local = before
        elif out is not None:  # a merge between boundaries
            assert out["applied"] and out["merged_after_steps"] == step % 4
            theta, v = nesterov(theta, v, expected_avg(averager.sent[len(applied)],
                                                       len(applied)))
            applied.append(step)
            expected = theta - (boundary_local - before)
            torch.testing.assert_close(flat(model).double(), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(sync.theta_global.double(), theta, rtol=0, atol=1e-6)
    last = sync.flush()
    if last is not None:
        theta, v = nesterov(theta, v, expected_avg(averager.sent[len(applied)], len(applied)))
        applied.append("flush")
    assert len(applied) == 3 and averager.rounds == [0, 1, 2]  # each round applied once
    torch.testing.assert_close(sync.theta_global.double(), theta, rtol=0, atol=1e-6)
    torch.testing.assert_close(flat(model).double(), theta, rtol=0, atol=1e-6)  # ends global
    if overlap_steps == 1:
        assert applied == [5, 9, "flush"]
    sync.close()


def _wait_sent(averager: TwoClusterAverager, n: int, timeout: float = 10.0) -> torch.Tensor:
    """The n-th delta the averager received (its thread may still be starting)."""
    deadline = time.monotonic() + timeout
    while len(averager.sent) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return averager.sent[n - 1]


def test_plain_gradient_mode_replaces_gradients_with_the_average() -> None:
    model = small_model()
    averager = TwoClusterAverager()
    sync = OuterSync(model, config=CFG, averager=averager, mode="gradient")
    assert sync.after_step(1) is None
    gen = torch.Generator().manual_seed(3)
    (model(torch.randn(4, 6, generator=gen)).pow(2).mean()).backward()
    local = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
    out = sync.after_backward()
    assert out is not None and out["outer_round"] == 0
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(averager.sent[0], local)
    torch.testing.assert_close(got.double(), expected_avg(local, 0), rtol=0, atol=1e-7)


class FailingAverager(TwoClusterAverager):
    def allreduce(self, round_id: int, tensor: torch.Tensor, info: Any = None) -> Result:
        raise ConnectionError("relay unreachable")


class ShortAverager(TwoClusterAverager):
    def allreduce(self, round_id: int, tensor: torch.Tensor, info: Any = None) -> Result:
        res = super().allreduce(round_id, tensor)
        res.tensor = res.tensor[:-1]
        return res


@pytest.mark.parametrize("averager,match", [(FailingAverager(), "relay unreachable"),
                                            (ShortAverager(), "expected 83")])
def test_plain_failed_round_raises_sync_error_and_leaves_params(averager, match) -> None:
    model = small_model()
    sync = OuterSync(model, config=CFG, averager=averager, inner_steps=1, mode="diloco",
                     overlap=False)
    before = flat(model).clone()
    with pytest.raises(SyncError, match=match):
        sync.after_step(1)
    assert torch.equal(flat(model), before)


def test_plain_empty_round_keeps_local_progress_and_catch_up_takes_the_global_state() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = TRAINABLE
    state = torch.linspace(-0.5, 0.5, n)
    averager = ScriptedAverager(script={
        # nobody present (own contribution rejected, peers late): nothing to apply
        1: lambda t: Result(torch.zeros(n), [], 1, 0, 0, 2.0),
        # this cluster was behind: a peer's theta_global after round 6
        2: lambda t: Result(torch.zeros(n), [], 6, 0, 4 * n, 0.5, global_state=state.clone()),
    })
    sync = OuterSync(model, config=CFG, averager=averager, inner_steps=1,
                     outer_lr=LR, outer_momentum=MU,
                     mode="diloco", overlap=False)
    theta, v = flat(model).double(), None
    plain_step(model, opt, 1)
    local = flat(model).clone()
    first = sync.after_step(1)
    theta, v = nesterov(theta, v, expected_avg(theta.float() - local, 0))
    torch.testing.assert_close(sync.theta_global.double(), theta, rtol=0, atol=1e-6)
    assert averager.published[0][0] == 0 and torch.equal(averager.published[0][1],
                                                         sync.theta_global)
    assert first["applied"] and not first["caught_up"]

    theta_before = sync.theta_global.clone()
    plain_step(model, opt, 2)
    local = flat(model).clone()
    empty = sync.after_step(2)
    assert not empty["applied"] and empty["clusters_present"] == 0
    assert torch.equal(sync.theta_global, theta_before)  # no outer step on nothing
    assert torch.equal(flat(model), local)  # local progress kept for the next round
    assert len(averager.published) == 1

    plain_step(model, opt, 3)
    local = flat(model).clone()
    back = sync.after_step(3)
    # the delta spans steps 2 and 3 (nothing lost), then the state replaces theta_global
    assert torch.equal(averager.sent[2], theta_before - local)
    assert back["caught_up"] and back["applied"] and back["outer_round"] == 6
    assert torch.equal(sync.theta_global, state) and torch.equal(flat(model), state)
    assert sync.round == 7
    plain_step(model, opt, 4)
    sync.after_step(4)
    assert averager.rounds == [0, 1, 2, 7]  # continues after the state's round
    sync.close()


def test_settings_come_from_the_plan_file(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    path = tmp_path / "sync.json"
    strict.write(default_sync_config(inner_steps=7, outer_lr=0.5, outer_momentum=0.8,
                                     overlap=True), path)
    assert path.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("NEBULA_SYNC_CONFIG", str(path))
    sync = OuterSync(small_model(), averager=TwoClusterAverager())
    assert (sync.inner_steps, sync.outer.lr, sync.outer.momentum, sync.overlap) == (7, 0.5, 0.8,
                                                                                    True)
    assert sync.mode == "diloco" and sync.outer.nesterov
    assert sync.round_timeout == CFG.round_timeout
    strict.write(default_sync_config(mode="gradient"), path)
    assert OuterSync(small_model(), averager=TwoClusterAverager()).mode == "gradient"
    for change, match in [({"inner_steps": "ten"}, "inner_steps: expected an integer"),
                          ({"inner_steps": 0}, "at least 1"),
                          ({"mode": "ring"}, "diloco, gradient"),
                          ({"retries": 3}, "unknown key"),
                          ({"outer_lr": None}, "outer_lr")]:
        data = {**strict.to_dict(CFG), **change}
        path.write_text(__import__("json").dumps(data))
        with pytest.raises(SyncError, match=match):
            OuterSync(small_model(), averager=TwoClusterAverager())


def test_without_a_plan_every_setting_must_be_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEBULA_SYNC_CONFIG", raising=False)
    with pytest.raises(SyncError, match="no sync config"):
        OuterSync(small_model(), averager=TwoClusterAverager(), inner_steps=3)


def test_state_dict_round_trip_and_mismatch() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = OuterSync(model, config=CFG, averager=TwoClusterAverager(), inner_steps=1, mode="diloco",
                     overlap=False)
    plain_step(model, opt, 1)
    sync.after_step(1)
    state = sync.state_dict()
    other = OuterSync(small_model(), config=CFG, averager=TwoClusterAverager(), inner_steps=1,
                      mode="diloco", overlap=False)
    other.load_state_dict(state)
    assert other.round == 1 and torch.equal(other.theta_global, sync.theta_global)
    assert torch.equal(other.outer.momentum_buffer, sync.outer.momentum_buffer)
    with pytest.raises(SyncError, match="different set"):
        OuterSync(small_model(freeze_first=True), config=CFG, averager=TwoClusterAverager(),
                  mode="diloco").load_state_dict(state)


# --- real DeepSpeed engines: 2 CPU ranks over gloo ---------------------------------------

INNER_LR = 1e-2
SGD_LR = 0.5
WORKER_TIMEOUT = 300  # the first run on a machine JIT-compiles an extension (~80 s)
TRAINABLE = 6 * 8 + 8 + 8 * 3 + 3
TRAINABLE_FROZEN = 8 * 3 + 3

# name -> engine settings. Every DiLoCo scenario: 2 rounds of 2 inner steps, then one step at
# lr 0 to see that the written values survive.
SCENARIOS: dict[str, dict[str, Any]] = {
    "z0_fp32": {"stage": 0, "bf16": False},
    "z0_bf16_fused": {"stage": 0, "bf16": True},  # FP16_Optimizer (flat fp32 master)
    "z0_bf16_unfused": {"stage": 0, "bf16": True, "torch_adam": True},  # FP16_UnfusedOptimizer
    "z1_fp32": {"stage": 1, "bf16": False},
    "z1_bf16": {"stage": 1, "bf16": True},
    "z2_bf16": {"stage": 2, "bf16": True},
    "z3_fp32": {"stage": 3, "bf16": False},
    "z1_bf16_frozen": {"stage": 1, "bf16": True, "frozen": True},
    "z1_bf16_overlap": {"stage": 1, "bf16": True, "overlap": True},
    "z0_fp32_gradient": {"stage": 0, "bf16": False, "mode": "gradient"},
    "z0_bf16_gradient": {"stage": 0, "bf16": True, "mode": "gradient"},
    "z1_gradient_refused": {"stage": 1, "bf16": False, "mode": "gradient"},
}
DILOCO = [n for n, s in SCENARIOS.items() if s.get("mode", "diloco") == "diloco"
          and not s.get("overlap")]


def _engine(scen: dict[str, Any]):
    import deepspeed

    model = small_model(freeze_first=scen.get("frozen", False))
    trainable = [p for p in model.parameters() if p.requires_grad]
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": scen["stage"]},
        "bf16": {"enabled": scen["bf16"]},
    }
    optimizer = None
    if scen.get("mode") == "gradient" and scen["stage"] == 0:  # SGD: the update is exact
        optimizer = torch.optim.SGD(trainable, lr=SGD_LR)
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {
            "lr": INNER_LR, "weight_decay": 0.0, "torch_adam": scen.get("torch_adam", False)}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable,
                                      optimizer=optimizer, config=cfg)
    return engine, model


def _batch(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
    return torch.randn(4, 6, generator=gen).to(dtype), torch.randn(4, 3, generator=gen)


def _loss(model_or_engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model_or_engine(x).float() - y).pow(2).mean()


def _trainable(engine) -> list[torch.nn.Parameter]:
    return [p for p in engine.module.parameters() if p.requires_grad]


def _master(engine) -> torch.Tensor:
    """The fp32 master values, read the way DeepSpeed stores them (the test's own oracle)."""
    from deepspeed.utils import safe_get_full_fp32_param

    params, opt = _trainable(engine), engine.optimizer
    if engine.zero_optimization_stage() >= 1:
        parts = [safe_get_full_fp32_param(p) for p in params]
    elif hasattr(opt, "fp32_groups_flat"):
        parts = list(opt.fp32_groups_flat)
    elif hasattr(opt, "fp32_groups"):
        parts = [m for group in opt.fp32_groups for m in group]
    else:
        parts = [p.data for p in params]
    return torch.cat([t.detach().float().reshape(-1) for t in parts]).clone()


def _params(engine) -> torch.Tensor:
    """The (possibly bf16) parameters the forward pass uses, all of them (frozen too)."""
    from deepspeed.runtime.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return torch.cat([p.detach().reshape(-1).clone() for p in params])


def _diloco(name: str, scen: dict[str, Any], rank: int) -> dict[str, Any]:
    engine, _ = _engine(scen)
    dtype = torch.bfloat16 if scen["bf16"] else torch.float32
    averager = TwoClusterAverager() if rank == 0 else None  # other ranks must never need one
    sync = OuterSync(engine, config=CFG, averager=averager, inner_steps=2,
                     outer_lr=LR, outer_momentum=MU,
                     mode="diloco", overlap=scen.get("overlap", False), overlap_steps=2)
    rec: dict[str, Any] = {"theta0": sync.theta_global.clone(), "params0": _params(engine),
                           "locals": [], "stats": [], "masters": [], "params": [], "thetas": []}
    boundaries = 3 if scen.get("overlap") else 2
    for step in range(1, 2 * boundaries + 1):
        x, y = _batch(step, rank, dtype)
        engine.backward(_loss(engine, x, y))
        engine.step()
        if step % 2 == 0:
            rec["locals"].append(_master(engine))
        out = sync.after_step(step)
        assert (out is None) == (step % 2 == 1), (step, out)
        if out is not None:
            rec["stats"].append(out)
            rec["masters"].append(_master(engine))
            rec["params"].append(_params(engine))
            rec["thetas"].append(sync.theta_global.clone())
    if scen.get("overlap"):
        rec["stats"].append(sync.flush())
        rec["masters"].append(_master(engine))
        rec["params"].append(_params(engine))
        rec["thetas"].append(sync.theta_global.clone())
    # One more step at lr 0 (weight decay is 0): the values written must survive it.
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    x, y = _batch(99, rank, dtype)
    engine.backward(_loss(engine, x, y))
    engine.step()
    assert sync.after_step(99) is None
    rec["survived_master"] = _master(engine)
    rec["survived_params"] = _params(engine)
    rec["optimizer"] = type(engine.optimizer).__name__
    if averager is not None:
        rec["sent"], rec["rounds"] = averager.sent, averager.rounds
    sync.close()
    return rec


def _gradient(name: str, scen: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    engine, model = _engine(scen)
    averager = TwoClusterAverager() if rank == 0 else None
    try:
        sync = OuterSync(engine, config=CFG, averager=averager, mode="gradient")
    except SyncError as exc:
        return {"refused": str(exc)}
    dtype = torch.bfloat16 if scen["bf16"] else torch.float32
    before = _master(engine)
    # The cluster-averaged gradient, computed by hand from every rank's batch.
    local = []
    for r in range(world):
        ref = copy.deepcopy(model)
        x, y = _batch(1, r, dtype)
        _loss(ref, x, y).backward()
        local.append(torch.cat([p.grad.float().reshape(-1) for p in ref.parameters()]))
    x, y = _batch(1, rank, dtype)
    engine.backward(_loss(engine, x, y))
    out = sync.after_backward()
    engine.step()
    rec = {"before": before, "after": _master(engine), "params": _params(engine),
           "cluster_grad": torch.stack(local).mean(0), "stats": out,
           "optimizer": type(engine.optimizer).__name__}
    if averager is not None:
        rec["sent"] = averager.sent
    sync.close()
    return rec


def _worker_main(out_dir: str) -> None:
    """One rank of the 2-rank DeepSpeed world: runs every scenario, saves what it saw."""
    import deepspeed
    import torch.distributed as dist

    faulthandler.dump_traceback_later(WORKER_TIMEOUT - 20, exit=True)  # stacks into the log
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, scen in SCENARIOS.items():
        t0 = time.perf_counter()
        try:
            if scen.get("mode") == "gradient":
                rec = _gradient(name, scen, rank, world)
            else:
                rec = _diloco(name, scen, rank)
        except Exception:
            # The other rank may now wait in a collective: record, then end this process so
            # that its peer fails fast (gloo notices the closed connection) instead of hanging.
            rec = {"error": traceback.format_exc()}
            torch.save(rec, Path(out_dir) / f"{name}-{rank}.pt")
            sys.stdout.flush()
            os._exit(1)
        rec["seconds"] = time.perf_counter() - t0
        torch.save(rec, Path(out_dir) / f"{name}-{rank}.pt")
        dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Launches the 2-rank world once; returns {scenario: [rank0 record, rank1 record]}."""
    out = tmp_path_factory.mktemp("sync-ds")
    port = _free_port()
    tests_dir = str(Path(__file__).resolve().parent)
    code = (f"import sys; sys.path.insert(0, {tests_dir!r}); "
            f"import test_sync; test_sync._worker_main({str(out)!r})")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEBULA_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs, logs = [], []
    try:
        for rank in range(2):
            log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed in finally
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-c", code], env={**env, "RANK": str(rank),
                                                   "LOCAL_RANK": str(rank)},
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + WORKER_TIMEOUT
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail("DeepSpeed workers did not finish:\n" + _tail(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        for log in logs:
            log.close()
        remove_shm_buffers(env)  # DeepSpeed's CPU comm op never unlinks its /dev/shm buffers
    runs: dict[str, list[dict[str, Any]]] = {}
    for name in SCENARIOS:
        files = [out / f"{name}-{r}.pt" for r in range(2)]
        runs[name] = [torch.load(f, weights_only=False) if f.exists() else
                      {"error": f"no record (a worker ended before this scenario):\n{_tail(out)}"}
                      for f in files]
    return runs


def _tail(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                     for p in sorted(out.glob("rank*.log")))


def _ok(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for rank, rec in enumerate(recs):
        assert "error" not in rec, f"rank {rank}:\n{rec['error']}"
    return recs


def _check_written(rec: dict[str, Any], master: torch.Tensor, params: torch.Tensor,
                   theta: torch.Tensor, expected: torch.Tensor, bf16: bool, frozen: bool) -> None:
    """master == theta_global (exactly), == the hand computation, and the params follow."""
    assert torch.equal(master, theta)
    torch.testing.assert_close(master.double(), expected, rtol=0, atol=1e-6)
    n_frozen = rec["params0"].numel() - master.numel() if frozen else 0
    assert torch.equal(params[:n_frozen], rec["params0"][:n_frozen])  # frozen layer untouched
    want = master.to(torch.bfloat16) if bf16 else master
    assert torch.equal(params[n_frozen:], want)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", DILOCO)
def test_deepspeed_round_writes_theta_global_that_survives_a_step(name, ds_runs) -> None:
    scen = SCENARIOS[name]
    r0, r1 = _ok(ds_runs[name])
    frozen = scen.get("frozen", False)
    n = TRAINABLE_FROZEN if frozen else TRAINABLE
    assert [t.numel() for t in r0["sent"]] == [n, n]  # only requires_grad params travel
    assert r0["rounds"] == [0, 1]
    assert torch.equal(r0["theta0"], r1["theta0"])
    theta, v = r0["theta0"].double(), None
    for k in range(2):
        # the delta is theta_global - theta_local, read from the fp32 master
        torch.testing.assert_close(r0["sent"][k].double(), theta - r0["locals"][k].double(),
                                   rtol=0, atol=1e-6)
        assert r0["sent"][k].norm() > 0  # the inner steps did move the weights
        theta, v = nesterov(theta, v, expected_avg(r0["sent"][k], k))
        for rec in (r0, r1):
            _check_written(rec, rec["masters"][k], rec["params"][k], rec["thetas"][k], theta,
                           scen["bf16"], frozen)
        assert torch.equal(r0["masters"][k], r1["masters"][k])  # the ranks stay identical
        assert torch.equal(r0["params"][k], r1["params"][k])
        stats = [r0["stats"][k], r1["stats"][k]]
        assert [s["outer_round"] for s in stats] == [k, k]
        assert [s["clusters_present"] for s in stats] == [2, 2]
        assert [s["wan_bytes_sent"] for s in stats] == [4 * n, 4 * n]
        assert stats[0]["clusters"] == ["a", "b"]
    for rec in (r0, r1):  # at lr 0 the next engine.step() keeps what the round wrote
        assert torch.equal(rec["survived_master"], rec["masters"][-1])
        assert torch.equal(rec["survived_params"], rec["params"][-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepspeed_wrappers_cover_both_zero0_bf16_master_copies(ds_runs) -> None:
    assert _ok(ds_runs["z0_bf16_fused"])[0]["optimizer"] == "FP16_Optimizer"
    assert _ok(ds_runs["z0_bf16_unfused"])[0]["optimizer"] == "FP16_UnfusedOptimizer"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepspeed_overlap_applies_each_round_once(ds_runs) -> None:
    r0, r1 = _ok(ds_runs["z1_bf16_overlap"])
    assert r0["rounds"] == [0, 1, 2]
    expected = overlap_expectations(r0["theta0"], r0["locals"], r0["sent"])
    assert len(expected) == len(r0["masters"]) == 4  # 3 boundaries + flush
    for k, (e_theta, e_params) in enumerate(expected):
        for rec in (r0, r1):
            torch.testing.assert_close(rec["thetas"][k].double(), e_theta, rtol=0, atol=1e-6)
            torch.testing.assert_close(rec["masters"][k].double(), e_params, rtol=0, atol=1e-6)
            assert torch.equal(rec["params"][k], rec["masters"][k].to(torch.bfloat16))
        assert torch.equal(r0["masters"][k], r1["masters"][k])
    for rec in (r0, r1):
        assert [s["applied"] for s in rec["stats"]] == [False, True, True, True]
        assert torch.equal(rec["survived_master"], rec["masters"][-1])
        assert torch.equal(rec["survived_params"], rec["params"][-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["z0_fp32_gradient", "z0_bf16_gradient"])
def test_deepspeed_gradient_mode_averages_between_backward_and_step(name, ds_runs) -> None:
    bf16 = SCENARIOS[name]["bf16"]
    r0, r1 = _ok(ds_runs[name])
    sent = r0["sent"][0]
    assert sent.numel() == TRAINABLE
    # what rank 0 sent is the cluster's all-reduced gradient (DeepSpeed reduced it in backward)
    tol = 2e-2 if bf16 else 1e-6
    torch.testing.assert_close(sent, r0["cluster_grad"], rtol=tol, atol=tol)
    avg = expected_avg(sent, 0)
    if bf16:  # the average lands in the bf16 .grad; SGD (lr 0.5) then steps the fp32 master
        avg = avg.to(torch.bfloat16).double()
    want = r0["before"].double() - SGD_LR * avg
    for rec in (r0, r1):
        torch.testing.assert_close(rec["after"].double(), want, rtol=0, atol=1e-6)
        want_params = rec["after"].to(torch.bfloat16) if bf16 else rec["after"]
        assert torch.equal(rec["params"], want_params)
        assert rec["stats"]["outer_round"] == 0
    assert torch.equal(r0["after"], r1["after"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepspeed_gradient_mode_refuses_zero_stage_1(ds_runs) -> None:
    refused = _ok(ds_runs["z1_gradient_refused"])
    assert all("ZeRO stage 0 only" in rec["refused"] for rec in refused)
