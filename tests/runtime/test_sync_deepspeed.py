"""OuterSync on real DeepSpeed engines (2 CPU ranks over gloo) in every supported ZeRO stage and
precision, with the in-test averager of helpers/sync_reference.py on rank 0."""

from __future__ import annotations

import copy
import faulthandler
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.jobs import REPO
from helpers.sshd_bed import free_port
from helpers.sync_reference import (
    CFG,
    LR,
    MU,
    TRAINABLE,
    TwoClusterAverager,
    expected_avg,
    nesterov,
    overlap_expectations,
    small_model,
)

from nebula_cli.agent.leftovers import remove_shm_buffers
from nebula_cli.runtime.sync import OuterSync, SyncError

# --- real DeepSpeed engines: 2 CPU ranks over gloo ---------------------------------------

INNER_LR = 1e-2
SGD_LR = 0.5
WORKER_TIMEOUT = 300  # the first run on a machine JIT-compiles an extension (~80 s)
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
    rec: dict[str, Any] = {"theta0": sync.full_theta_global(), "params0": _params(engine),
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
            rec["thetas"].append(sync.full_theta_global())
    if scen.get("overlap"):
        rec["stats"].append(sync.flush())
        rec["masters"].append(_master(engine))
        rec["params"].append(_params(engine))
        rec["thetas"].append(sync.full_theta_global())
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


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Launches the 2-rank world once; returns {scenario: [rank0 record, rank1 record]}."""
    out = tmp_path_factory.mktemp("sync-ds")
    port = free_port()
    here, tests_dir = str(Path(__file__).resolve().parent), str(REPO / "tests")
    code = (f"import sys; sys.path[:0] = [{here!r}, {tests_dir!r}]; "
            f"import test_sync_deepspeed; test_sync_deepspeed._worker_main({str(out)!r})")
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
