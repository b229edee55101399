"""OuterSync: the outer optimizer's arithmetic and the round logic on a plain module (real
DeepSpeed engines: test_sync_deepspeed.py).

The averagers (helpers/sync_reference.py) are in-test stand-ins that return a known average; they
sit below the real relay test of the same path (runtime.sync -> relay.client -> relay server).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.plan_defaults import default_sync_config
from helpers.sync_reference import (
    CFG,
    LR,
    MU,
    TRAINABLE,
    Result,
    ScriptedAverager,
    TwoClusterAverager,
    expected_avg,
    nesterov,
    overlap_expectations,
    plain_step,
    small_model,
)

from nebula_cli.config import strict
from nebula_cli.runtime.outer_files import Saved
from nebula_cli.runtime.sync import OuterOptimizer, OuterSync, SyncError

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


def flat(model: torch.nn.Module, trainable_only: bool = True) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()
                      if p.requires_grad or not trainable_only])


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
    assert sync.heap.trims >= 1  # after a round (at most once per 10 s)
    assert [r["outer_round"] for r in results] == [0, 1]
    assert results[0]["clusters_present"] == 2 and results[0]["clusters"] == ["a", "b"]
    assert results[0]["wan_bytes_sent"] == 27 * 4 and results[0]["delta_norm"] > 0
    assert torch.equal(flat(model[0], trainable_only=False), frozen)
    sync.close()
    sync.close()
    assert averager.closed == 1
    with pytest.raises(SyncError, match="closed"):
        sync.after_step(7)


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
    state = sync.saved_part()
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
    (a fixed count, or the agreed one: 1 before any), and the parameters keep the progress
    made since the boundary; every delta sent is theta_global at its boundary minus the local
    params."""
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
    assert applied == [5, 9, "flush"]  # 1 step after each boundary (nothing agreed: 1)
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
    state = Saved([{"format": 2, **sync.saved_part()}])
    other = OuterSync(small_model(), config=CFG, averager=TwoClusterAverager(), inner_steps=1,
                      mode="diloco", overlap=False)
    other.load_saved(state, contributes=True)
    assert other.round == 1 and torch.equal(other.theta_global, sync.theta_global)
    assert torch.equal(other.outer.momentum_buffer, sync.outer.momentum_buffer)
    assert other.theta_global.data_ptr() != sync.theta_global.data_ptr()  # its own memory
    with pytest.raises(SyncError, match="different set"):
        OuterSync(small_model(freeze_first=True), config=CFG, averager=TwoClusterAverager(),
                  mode="diloco").load_saved(state, contributes=True)


def test_a_gradient_mode_state_round_trips() -> None:
    """Gradient mode keeps no theta_global: its saved state (the exchange count) loads back."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = OuterSync(model, config=CFG, averager=TwoClusterAverager(), mode="gradient")
    model(torch.ones(2, 6)).sum().backward()
    sync.after_backward()
    opt.step()
    state = Saved([{"format": 2, **sync.saved_part()}])
    other = OuterSync(small_model(), config=CFG, averager=TwoClusterAverager(), mode="gradient")
    other.load_saved(state, contributes=True)
    assert other.grad_round == sync.grad_round == 1 and other.theta_global.numel() == 0
