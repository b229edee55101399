"""The automatic runtime hook without DeepSpeed processes: the plan puts it on the workers'
PYTHONPATH (and only theirs, and only with runtime.auto), its sitecustomize installs it and
chains to the one it shadows, `OuterSync.finish` makes the last round, and the engine driver
counts optimizer steps at accumulation boundaries and stands aside for an explicit OuterSync.

The engine here is a small stand-in for DeepSpeed's (global_steps moves at the boundary); the
real engines, relays and `nebula launch` are in tests/e2e/test_ds_plain.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.jobs import HOOK_DIR, REPO
from helpers.plan_defaults import default_sync_config, minimal_spec

from nebula_cli.config import jobplan, plan_model, worlds
from nebula_cli.config.spec import JobSpec, parse_spec
from nebula_cli.runtime import metrics
from nebula_cli.runtime.engine import LOG_EVERY, EngineDriver
from nebula_cli.runtime.sync import OuterSync
from nebula_cli.transport.local.conn import LocalConn

CFG = default_sync_config()


# --- the plan ---------------------------------------------------------------------------------


def plan_of(spec: JobSpec, shares_files: bool) -> plan_model.JobPlan:
    sites = {worlds.site_key(c, h): plan_model.Site(
        conn=LocalConn(name=h.host, home="/nowhere", python="python3"),
        home=f"/home/u/.nebula-{c.name}", address="127.0.0.1", bind="127.0.0.1",
        python="/opt/py/bin/python3", shares_files=shares_files)
        for c in spec.clusters for h in c.hosts}
    ports = plan_model.Ports(masters={c.name: 29500 + i for i, c in enumerate(spec.clusters)},
                          relays={c.name: (29400, 29401) for c in spec.clusters})
    certs = plan_model.Certs(ca=b"CA", relays={c.name: (b"c", b"k") for c in spec.clusters},
                          workers={worlds.site_key(c, h): (b"c", b"k")
                                   for c in spec.clusters for h in c.hosts})
    return jobplan.build_plan(spec, "job-1", sites=sites, ports=ports, certs=certs)


def test_spec_runtime_auto_defaults_on_and_refuses_unknown_keys() -> None:
    assert minimal_spec().runtime.auto is True
    text = "name: j\nrun: python t.py\nclusters: [{name: a, transport: local, hosts: [a1]}]\n"
    assert parse_spec(text + "runtime: {auto: false}\n", base_dir=REPO).runtime.auto is False
    with pytest.raises(Exception, match="runtime.hook"):
        parse_spec(text + "runtime: {hook: false}\n", base_dir=REPO)


@pytest.mark.parametrize("shares_files", [True, False])
def test_workers_start_with_the_hook_first_on_pythonpath(shares_files: bool) -> None:
    plan = plan_of(minimal_spec(), shares_files)
    for agent in plan.role(plan_model.WORKER):
        for proc in agent.config.processes:
            first, *rest = proc.env["PYTHONPATH"].split(":")
            if shares_files:  # this machine's package, which holds only the sitecustomize
                assert Path(first) == HOOK_DIR
                assert sorted(p.name for p in HOOK_DIR.iterdir()
                              if p.name != "__pycache__") == ["sitecustomize.py"]
                assert rest == []
            else:  # the uploaded copy, before the uploaded package itself
                lib = plan_model.lib_dir(agent.job_root)
                assert first == f"{lib}/nebula_cli/runtime/autohook" and rest == [lib]
    for relay in plan.role(plan_model.RELAY):  # relays never get the hook
        assert "autohook" not in relay.config.processes[0].env.get("PYTHONPATH", "")


def test_runtime_auto_false_leaves_pythonpath_alone_and_a_users_path_is_kept() -> None:
    base = minimal_spec().model_dump()
    off = JobSpec.model_validate({**base, "runtime": {"auto": False}},
                                 context={"base_dir": REPO})
    for agent in plan_of(off, True).role(plan_model.WORKER):
        assert "PYTHONPATH" not in agent.config.processes[0].env
    mine = JobSpec.model_validate({**base, "env": {"PYTHONPATH": "/opt/mine"}},
                                  context={"base_dir": REPO})
    for agent in plan_of(mine, True).role(plan_model.WORKER):
        assert agent.config.processes[0].env["PYTHONPATH"] == f"{HOOK_DIR}:/opt/mine"


# --- the sitecustomize -------------------------------------------------------------------------


def test_sitecustomize_installs_the_hook_and_runs_the_one_it_shadows(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nTHEIRS = os.getpid()\n")
    probe = textwrap.dedent("""
        import json, sys, sitecustomize
        from nebula_cli.runtime import hook
        print(json.dumps({
            "finders": [type(f).__name__ for f in sys.meta_path],
            "theirs": getattr(sitecustomize, "THEIRS", None),
            "installed": hook._state.installed,
            "heavy": [m for m in ("torch", "deepspeed") if m in sys.modules]}))
    """)
    env = {**os.environ, "PYTHONPATH": f"{HOOK_DIR}:{theirs}"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, check=True)
    seen = json.loads(out.stdout)
    assert seen["finders"][0] == "PatchOnImport" and seen["installed"] is True
    assert isinstance(seen["theirs"], int)  # the shadowed sitecustomize ran
    assert seen["heavy"] == []  # nothing heavy at interpreter start
    assert "nebula:" not in out.stderr  # nothing to say for a process that trained nothing


def test_a_torch_process_without_an_engine_says_so_once(tmp_path: Path) -> None:
    """A script that imports torch and never calls deepspeed.initialize: one line in its log
    and one metric record (rank 0 only)."""
    metrics_file = tmp_path / "m.jsonl"
    env = {**os.environ, "PYTHONPATH": str(HOOK_DIR), "NEBULA_METRICS_FILE": str(metrics_file),
           "NEBULA_SYNC_CONFIG": str(tmp_path / "sync.json"), "RANK": "0"}
    run = [sys.executable, "-c", "import torch; print(torch.ones(2).sum().item())"]
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stderr.count("no DeepSpeed engine was seen") == 1
    assert "no cross-cluster sync happened" in out.stderr
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [(r["no_deepspeed_engine"], r["cross_cluster_sync"]) for r in records] == [
        (True, False)]
    env["RANK"] = "1"  # another rank of the cluster stays quiet
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert "no DeepSpeed engine" not in out.stderr and len(metrics_file.read_text().split()) == 1
    del env["RANK"]  # a process with no rank of its own (issue 30: the agent's world teller
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert "no DeepSpeed engine" not in out.stderr and len(metrics_file.read_text().split()) == 1


def test_the_agents_world_teller_neither_loads_the_hook_nor_writes_a_ranks_records(
        tmp_path: Path) -> None:
    """Issue 30: the helper a host's agent starts when a rank failed (`python -m
    nebula_cli.runtime.worldwatch abort`, with the rank's environment) wrote a step-0
    `no_deepspeed_engine` record into the restarted rank's metrics. Its environment, as the
    agent makes it, carries neither the hook nor the rank's files; run with it, the teller
    (here told of a world whose store is gone) writes nothing there."""
    from nebula_cli.config.parts import helper_env

    metrics_file = tmp_path / "rank1.jsonl"
    rank_env = {**os.environ, "PYTHONPATH": str(HOOK_DIR), "RANK": "1",
                "NEBULA_METRICS_FILE": str(metrics_file),
                "NEBULA_SYNC_CONFIG": str(tmp_path / "sync.json"),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9", "WORLD_SIZE": "2"}
    env = helper_env(rank_env)
    env.pop("RANK")  # as the agent does
    assert "PYTHONPATH" not in env and "NEBULA_METRICS_FILE" not in env
    proc = subprocess.run([sys.executable, "-c", "import torch, sys; "
                           "print('nebula_cli.runtime.hook' in sys.modules)"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "False"  # the hook was not loaded
    assert not metrics_file.exists()


# --- OuterSync.finish on a plain module --------------------------------------------------------


class Averager:
    """Averages this cluster's delta with a fixed, known other cluster's (half of it)."""

    def __init__(self) -> None:
        self.rounds: list[int] = []
        self.sent: list[torch.Tensor] = []

    def allreduce(self, round_id: int, tensor: torch.Tensor, info: Any = None) -> Any:
        from types import SimpleNamespace

        self.rounds.append(round_id)
        self.sent.append(tensor.clone())
        return SimpleNamespace(tensor=0.75 * tensor, present=["a", "b"], round_id=round_id,
                               bytes_sent=4, bytes_received=4, seconds=0.0)

    def close(self) -> None:
        pass


def trained(steps: int, inner: int, overlap: bool) -> tuple[OuterSync, Averager, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = Averager()
    sync = OuterSync(model, config=CFG, averager=averager, inner_steps=inner, mode="diloco",
                     overlap=overlap, overlap_steps=inner if overlap else None)
    for step in range(1, steps + 1):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        sync.after_step(step)
    return sync, averager, model


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("overlap", [False, True])
def test_finish_makes_a_last_round_over_the_steps_since_the_boundary(overlap: bool) -> None:
    sync, averager, model = trained(steps=7, inner=3, overlap=overlap)
    assert averager.rounds == [0, 1]
    local = flat(model).clone()
    theta_before = sync.theta_global.clone()
    stats = sync.finish()
    assert averager.rounds == [0, 1, 2] and stats["final_round"] is True
    assert stats["outer_round"] == 2 and stats["applied"] is True
    assert torch.equal(flat(model), sync.theta_global)  # every cluster ends on theta_global
    if not overlap:  # the last delta is exactly the progress of the 1 step after step 6
        torch.testing.assert_close(averager.sent[-1], theta_before - local)
    assert sync.finish() is None and averager.rounds == [0, 1, 2]  # nothing pending any more
    sync.close()


def test_finish_at_a_boundary_makes_no_extra_round() -> None:
    sync, averager, model = trained(steps=6, inner=3, overlap=False)
    assert sync.finish() is None and averager.rounds == [0, 1]
    assert torch.equal(flat(model), sync.theta_global)
    sync.close()


# --- the engine driver on a stand-in engine ----------------------------------------------------


class StandInEngine(torch.nn.Module):
    """What the driver uses of a DeepSpeedEngine: backward, step (an optimizer step every
    `accum` calls, when global_steps moves), train_batch_size, get_lr, module."""

    def __init__(self, accum: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.module = torch.nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.05)
        self.accum, self.micro, self.global_steps = accum, 0, 0
        self.backward_kwargs: list[dict[str, Any]] = []

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.backward_kwargs.append(kwargs)
        (loss / self.accum).backward()
        return loss

    def step(self) -> None:
        self.micro += 1
        if self.micro % self.accum == 0:
            self.opt.step()
            self.opt.zero_grad()
            self.global_steps += 1

    def train_batch_size(self) -> int:
        return 8 * self.accum

    def get_lr(self) -> list[float]:
        return [0.05]


def train(engine: StandInEngine, micro_steps: int) -> None:
    for _ in range(micro_steps):
        loss = engine.module(torch.randn(8, 3)).pow(2).mean()
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def metrics_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(metrics.METRICS_FILE_ENV, str(tmp_path / "m.jsonl"))
    for name in ("NEBULA_SYNC_CONFIG", "NEBULA_DRY_RUN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(metrics, "_script", {"calls": 0, "step": 0})
    return tmp_path / "m.jsonl"


def test_driver_counts_optimizer_steps_at_boundaries_and_records_metrics(
        metrics_file: Path) -> None:
    engine = StandInEngine(accum=2)
    driver = EngineDriver(engine, watch_stop=False)
    assert isinstance(engine, StandInEngine) and engine.step.__wrapped__ is not None
    train(engine, micro_steps=2 * (LOG_EVERY + 3))
    assert driver.steps == LOG_EVERY + 3
    assert all(k == {"scale_wrt_gas": False} for k in engine.backward_kwargs)  # forwarded
    recs = records(metrics_file)
    assert [r["step"] for r in recs] == [1, LOG_EVERY]
    assert recs[1]["samples_per_s"] == pytest.approx(recs[1]["steps_per_s"] * 16)
    assert all(r["loss"] > 0 for r in recs) and recs[1]["lr"] == 0.05
    driver.finish("exit")
    driver.finish("exit")  # once only
    (final,) = [r for r in records(metrics_file) if r.get("final")]
    assert final["step"] == LOG_EVERY + 3 and final["cross_cluster_sync"] is False
    assert len(final["param_sha256"]) == 64 and final["ended_by"] == "exit"


def test_driver_stands_aside_for_an_explicit_outer_sync(metrics_file: Path) -> None:
    engine = StandInEngine(accum=1)
    driver = EngineDriver(engine, watch_stop=False)
    averager = Averager()
    explicit = OuterSync(engine, config=CFG, averager=averager, inner_steps=2)
    train(engine, micro_steps=4)
    assert driver.aside and driver.sync is None
    assert averager.rounds == []  # the script calls explicit.after_step itself; nobody else
    driver.finish("exit")
    assert records(metrics_file) == []
    explicit.close()


def test_driver_writes_no_records_when_the_script_logs_itself(metrics_file: Path) -> None:
    engine = StandInEngine(accum=1)
    driver = EngineDriver(engine, watch_stop=False)
    metrics.log(step=0, note="the script's own")
    train(engine, micro_steps=LOG_EVERY)
    driver.finish("exit")
    assert [r.get("note") for r in records(metrics_file)] == ["the script's own"]


def test_a_stop_request_finishes_and_leaves_with_status_0(metrics_file: Path) -> None:
    """SIGTERM (the hook's handler sets stop_requested): at the next optimizer step the ranks
    agree, the driver finishes (last round, final record) and the step raises SystemExit(0)."""
    engine = StandInEngine(accum=2)
    driver = EngineDriver(engine, watch_stop=True)
    averager = Averager()
    driver.sync = OuterSync(engine, config=CFG, averager=averager, inner_steps=3)
    driver.started = True
    train(engine, micro_steps=2 * 4)  # 4 optimizer steps: round 0 after step 3
    driver.stop_requested = True
    engine.backward(engine.module(torch.randn(8, 3)).pow(2).mean())
    engine.step()  # a micro-step, not a boundary: nothing happens yet
    engine.backward(engine.module(torch.randn(8, 3)).pow(2).mean())
    with pytest.raises(SystemExit) as leave:
        engine.step()
    assert leave.value.code == 0 and driver.finished and averager.rounds == [0, 1]
    (final,) = [r for r in records(metrics_file) if r.get("final")]
    assert final["ended_by"] == "SIGTERM" and final["step"] == 5 and final["final_round"]
    assert final["final_round_present"] == 2 and final["outer_rounds"] == 2


class NeverAnswers(Averager):
    """An averager whose relay waits for a cluster that never finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = threading.Event()

    def final_state(self, wait: float | None) -> Any:
        self.asked.set()
        threading.Event().wait()


def test_a_stop_request_during_the_final_wait_ends_it_and_the_run_finishes(
        metrics_file: Path) -> None:
    """A SIGTERM that comes while rank 0 waits for the other clusters to finish (the
    hook's handler sets stop_requested) ends the wait: the final record is written (the
    final checkpoint would be too) instead of the kill after the grace finding it blocked."""
    engine = StandInEngine(accum=1)
    driver = EngineDriver(engine, watch_stop=True)
    averager = NeverAnswers()
    driver.sync = OuterSync(engine, config=CFG, averager=averager, inner_steps=3)
    driver.started = True
    train(engine, micro_steps=4)
    ending = threading.Thread(target=driver.finish, args=("exit",), daemon=True)
    ending.start()
    assert averager.asked.wait(30)
    driver.stop_requested = True
    ending.join(15)
    assert not ending.is_alive()
    (final,) = [r for r in records(metrics_file) if r.get("final")]
    assert final["ended_by"] == "exit" and final["step"] == 4 and final["final_round"]
    assert "final_state_round" not in final and averager.rounds == [0, 1]
