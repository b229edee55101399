"""Checkpoints (nebula_cli.runtime.checkpoint): atomic publish, keep, a half-written tag never
picked (a save SIGKILLed mid-way in a real process), an unwritable directory or a full disk
that leaves training going, the ranks' agreement on a tag; and end to end through `nebula
launch` (real DeepSpeed on CPU/gloo, real relays): a worker SIGKILLed at a chosen step is
restarted by its agent, resumes from its checkpoint, and the job ends SUCCEEDED with identical
parameters everywhere.

Below the end-to-end test, a stand-in engine writes DeepSpeed's part (one torch file per tag);
the end-to-end test runs the same path with a real DeepSpeedEngine."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.checkpoint_jobs import (
    _records,
    kill_rank,
    newest_checkpoint,
    slowed_ds_plain,
    wait_ended,
)
from helpers.checkpoint_standins import StandInEngine, StandInSync
from helpers.jobs import CLI, REPO, job_processes, shm_leftovers, wait_for, wait_in_job
from helpers.plan_defaults import default_checkpoint

from nebula_cli.config import staging
from nebula_cli.runtime import checkpoint as ck
from nebula_cli.runtime import metrics


@pytest.fixture
def metrics_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv(metrics.METRICS_FILE_ENV, str(path))
    return path


@pytest.fixture
def agent_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An agent's folder for this process: checkpoints are staged in /dev/shm, recorded there."""
    path = tmp_path / "agent"
    path.mkdir(mode=0o700)
    monkeypatch.setenv(staging.AGENT_DIR_ENV, str(path))
    return path


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train(engine: StandInEngine, step: int) -> None:
    engine.global_steps = step
    with torch.no_grad():
        engine.module.weight.add_(0.01)


def test_saves_publish_atomically_keep_the_newest_and_load_back(
        tmp_path: Path, metrics_file: Path, agent_dir: Path) -> None:
    directory = tmp_path / "ckpt"
    settings = default_checkpoint(directory, every=5)
    engine, sync = StandInEngine(), StandInSync(0.0)
    saver = ck.Checkpointer(engine, settings, sync=sync)
    saved = []
    for step in range(1, 23):
        train(engine, step)
        sync.theta += 1.0
        sync.round = step
        if saver.maybe_save(step):
            saved.append(step)
    assert saver.maybe_save(22, final=True) and not saver.maybe_save(22, final=True)
    staged_in = staging.recorded(agent_dir)  # in memory, in the directory the agent knows
    assert staged_in is not None and set(engine.saved_to) == {str(staged_in)}
    saver.close()
    assert saved == [5, 10, 15, 20]
    assert ck.complete_steps(directory) == [20, 22][-settings.keep:]
    assert (directory / ck.LATEST).read_text() == "step22"
    assert sorted(p.name for p in directory.iterdir()) == [
        ck.LATEST, *[f"step{s}" for s in [20, 22][-settings.keep:]]]  # nothing half-made
    assert not staged_in.exists() and staging.recorded(agent_dir) is None  # gone at close
    published = [r["checkpoint_step"] for r in records(metrics_file) if "checkpoint_step" in r]
    assert published == [5, 10, 15, 20, 22]
    assert all(r["checkpoint_stall_s"] >= 0 for r in records(metrics_file)
               if "checkpoint_step" in r)

    weights = engine.module.weight.detach().clone()
    fresh, fresh_sync = StandInEngine(seed=1), StandInSync(-1.0)
    loader = ck.Checkpointer(fresh, settings, sync=fresh_sync)
    assert loader.load_newest() == 22
    assert torch.equal(fresh.module.weight, weights) and fresh.global_steps == 22
    assert torch.equal(fresh_sync.theta, torch.full((3,), 22.0)) and fresh_sync.round == 22
    assert [r["resumed_from_step"] for r in records(metrics_file)
            if "resumed_from_step" in r] == [22]


def test_every_larger_than_the_run_saves_only_the_final_checkpoint(tmp_path: Path,
                                                                    metrics_file: Path) -> None:
    settings = default_checkpoint(tmp_path / "ckpt", every=1000)
    engine = StandInEngine()
    saver = ck.Checkpointer(engine, settings)
    assert not any(saver.maybe_save(step) for step in range(1, 40))
    assert saver.maybe_save(39, final=True)
    saver.close()
    assert ck.complete_steps(settings.dir) == [39]
    assert ck.Checkpointer(StandInEngine(), settings).load_newest() == 39


def test_with_no_thread_to_be_had_the_final_checkpoint_is_published_in_place(
        tmp_path: Path, metrics_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook's final checkpoint is made in atexit, where Python 3.12 may refuse new threads:
    the checkpoint is then published on the calling thread."""
    settings = default_checkpoint(tmp_path / "ckpt", every=1000)
    saver = ck.Checkpointer(StandInEngine(), settings)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert saver.maybe_save(7, final=True)
    saver.close()
    assert ck.complete_steps(settings.dir) == [7]
    assert [r["checkpoint_step"] for r in records(metrics_file) if "checkpoint_step" in r] == [7]


def test_no_checkpoint_yet_starts_from_the_beginning(tmp_path: Path) -> None:
    settings = default_checkpoint(tmp_path / "never-made")
    assert ck.Checkpointer(StandInEngine(), settings).load_newest() is None


KILLED_SAVE = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from helpers.plan_defaults import default_checkpoint
from helpers.checkpoint_standins import StandInEngine
from nebula_cli.runtime import checkpoint as ck

directory, phase, ready = sys.argv[1], sys.argv[2], Path(sys.argv[3])
engine = StandInEngine()
saver = ck.Checkpointer(engine, default_checkpoint(directory, every=10))
engine.global_steps = 10
assert saver.save(10)
saver.wait()

def hang(*args, **kwargs):
    ready.write_text(phase)
    time.sleep(120)

if phase == "deepspeed":   # in DeepSpeed's save_checkpoint (the staging copy)
    real = engine.save_checkpoint
    def save_checkpoint(save_dir, tag, save_latest=True):
        real(save_dir, tag, save_latest)
        hang()
    engine.save_checkpoint = save_checkpoint
else:                      # publishing: files copied, before the marker and the rename
    ck._fsync_tree = hang
engine.global_steps = 20
saver.save(20)
saver.wait()
"""


@pytest.mark.parametrize("phase", ["deepspeed", "publish"])
def test_a_save_killed_mid_way_is_never_picked(tmp_path: Path, phase: str,
                                               agent_dir: Path) -> None:
    directory, ready = tmp_path / "ckpt", tmp_path / "ready"
    script = tmp_path / "killed_save.py"
    script.write_text(KILLED_SAVE.format(tests=str(REPO / "tests")))
    proc = subprocess.Popen([sys.executable, str(script), str(directory), phase, str(ready)],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert ck.complete_steps(directory) == [10]
    assert (directory / ck.LATEST).read_text() == "step10"
    staged_in = staging.recorded(agent_dir)  # what the killed process staged in memory
    assert staged_in is not None and staged_in.is_dir()
    if phase == "publish":  # the half-published copy is there, under a name never loaded
        assert [p.name for p in directory.glob(".tmp-step20-*")]
    engine = StandInEngine(seed=5)
    loader = ck.Checkpointer(engine, default_checkpoint(directory))
    assert loader.load_newest() == 10 and engine.global_steps == 10
    assert sorted(p.name for p in directory.iterdir()) == [ck.LATEST, "step10"]  # swept
    assert not staged_in.exists() and staging.recorded(agent_dir) is None


def test_an_unwritable_directory_is_reported_and_training_goes_on(
        tmp_path: Path, metrics_file: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # refused even to root, unlike a chmod
    engine = StandInEngine()
    saver = ck.Checkpointer(engine, default_checkpoint(blocker / "ckpt", every=2))
    results = []
    for step in range(1, 7):
        train(engine, step)
        results.append(saver.maybe_save(step))
    saver.close()
    assert results == [False] * 6
    errors = [r for r in records(metrics_file) if "checkpoint_error" in r]
    assert [r["step"] for r in errors] == [2, 4, 6] and errors[-1]["checkpoint_errors"] == 3
    assert "is not writable" in errors[0]["checkpoint_error"]
    assert str(blocker) in errors[0]["checkpoint_error"]


FULL_DISK = """
import resource, signal, sys
sys.path.insert(0, {tests!r})
from helpers.plan_defaults import default_checkpoint
from helpers.checkpoint_standins import StandInEngine, StandInSync
from nebula_cli.runtime import checkpoint as ck

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
engine, sync = StandInEngine(), StandInSync(1.0)
sync.theta = sync.theta.repeat(200_000)        # an outer state file of about 2.4 MB
saver = ck.Checkpointer(engine, default_checkpoint(sys.argv[1], every=1), sync=sync)
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))  # the disk is "full"
for step in range(1, 4):
    engine.global_steps = step
    saver.maybe_save(step)
saver.close()
print("trained to step", engine.global_steps)
"""


def test_a_full_disk_while_saving_is_reported_and_training_goes_on(
        tmp_path: Path, metrics_file: Path) -> None:
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK.format(tests=str(REPO / "tests")))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "trained to step 3" in proc.stdout
    errors = [r for r in records(metrics_file) if "checkpoint_error" in r]
    assert [r["step"] for r in errors] == [1, 2, 3]
    assert all("writing the outer state" in r["checkpoint_error"] for r in errors)
    assert ck.complete_steps(tmp_path / "ckpt") == []
    assert "not saved" in proc.stderr


@pytest.mark.parametrize(("per_rank", "agreed"), [
    ([[10, 20], [10, 20], [10, 20]], 20),
    ([[10, 20], [10], [10, 20]], 10),        # a crash before one host published step 20
    ([[20, 30], [10, 20], [30]], None),      # keep 1 (or 2) after crashes: nothing in common
    ([[5, 10, 15], [10, 15, 20], [1, 10]], 10),
    ([[], [10], [10]], None),
])
def test_the_ranks_agree_on_the_newest_step_every_rank_has(
        per_rank: list[list[int]], agreed: int | None) -> None:
    """Each rank in its own thread; the all-reduce is a barrier over the ranks' values."""
    n = len(per_rank)
    values: list[tuple[int, int]] = [(0, 0)] * n
    barrier = threading.Barrier(n)
    results: list[int | None] = [None] * n
    calls = [0] * n

    def reduce_for(rank: int):
        def reduce(low: int, high: int) -> tuple[int, int]:
            calls[rank] += 1
            values[rank] = (low, high)
            barrier.wait()
            out = (min(v[0] for v in values), max(v[1] for v in values))
            barrier.wait()
            return out
        return reduce

    def run(rank: int) -> None:
        results[rank] = ck.agree_step(per_rank[rank], reduce_for(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [agreed] * n
    assert len(set(calls)) == 1  # every rank made the same number of all-reduces


def test_node_local_storage_is_switched_on_for_a_built_engine() -> None:
    class Config:
        use_node_local_storage = False

    class Writers:
        def is_data_parallel_writer(self, rank: int) -> bool:
            return rank == 0

    class Engine:
        _config, checkpoint_engine = Config(), Writers()
        local_rank, save_non_zero_checkpoint = 0, False  # global rank 1: not a writer so far

        def zero_optimization_partition_weights(self) -> bool:
            return False

    engine = Engine()
    ck.enable_node_local_storage(engine)
    assert engine._config.use_node_local_storage and engine.save_non_zero_checkpoint
    engine.local_rank = 1
    engine._config.use_node_local_storage = False
    ck.enable_node_local_storage(engine)
    assert not engine.save_non_zero_checkpoint


# --- end to end: a worker SIGKILLed at a chosen step resumes from its checkpoint -------------

STEPS, EVERY = 100, 10


@pytest.mark.slow
def test_a_killed_worker_resumes_from_its_checkpoint_and_the_job_succeeds(
        cli: CLI, tmp_path: Path) -> None:
    spec_path = slowed_ds_plain(tmp_path, "ckptkill", STEPS, max_restarts=1,
                                checkpoint={"every": EVERY}, clusters=[
        {"name": "east", "transport": "local", "hosts": [{"host": "e1", "slots": 2}]},
        {"name": "west", "transport": "local", "hosts": [{"host": "w1"}]}])
    job_id = cli("launch", str(spec_path), "--detach", check=True).stdout.strip()
    seen = wait_in_job(cli, job_id, lambda: (n := newest_checkpoint(cli, job_id, "east"))
                       >= 2 * EVERY and n, 120, f"east's checkpoint of step {2 * EVERY}")
    kill_rank(job_id, "east", "1")
    st = wait_ended(cli, job_id, timeout=240)
    assert st["state"] == "SUCCEEDED", st
    (east,) = [h for h in st["hosts"] if h["role"] == "worker" and h["cluster"] == "east"]
    assert east["restarts"] == 1

    recs = _records(cli, job_id)
    resumed = [r["resumed_from_step"] for r in recs if "resumed_from_step" in r
               and not r.get("final")]
    assert len(resumed) == 1, resumed  # east's rank 0 (its host's writer), once
    assert seen <= resumed[0] < STEPS and resumed[0] % EVERY == 0
    (at,) = [r["ts"] for r in recs if "resumed_from_step" in r and not r.get("final")]
    before = max(r["step"] for r in recs if r["cluster"] == "east" and r["ts"] < at)
    assert before - resumed[0] <= EVERY  # no step before the checkpoint redone beyond `every`
    finals = [r for r in recs if r.get("final")]
    assert len(finals) == 3 and all(r["step"] == STEPS for r in finals)
    assert len({r["param_sha256"] for r in finals}) == 1, finals
    assert {r["resumed_from_step"] for r in finals if r["cluster"] == "east"} == {resumed[0]}
    logs = "".join(p.read_text() for p in
                   (cli.home / "jobs" / job_id).glob("east/*/worker/logs/rank0.log"))
    assert f"nebula: resumed from checkpoint step {resumed[0]} (" in logs
    shown = cli("status", job_id, check=True).stdout  # each cluster's newest checkpoint
    assert f"{STEPS} (resumed {resumed[0]})" in shown, shown
    page = tmp_path / "report.html"  # the report marks east's restart, and no other
    cli("report", job_id, "--output", str(page), check=True)
    restarts = re.findall(r"<tr><td>(\w+)</td><td>(\d+)</td><td>\d+</td>", page.read_text())
    assert restarts == [("east", "1"), ("west", "0")], restarts
    assert job_processes(job_id) == []
    assert shm_leftovers(cli.home / "jobs" / job_id) == []  # also the killed world's
