"""Nebula-I's two phases as one workflow (examples/nebula-i/): phase a's two clusters
pre-train the GPT of examples/gpt through the relays and save checkpoints; phase b's teacher
cluster serves it (`teacher: {from_job: <phase a's name>}`: its newest checkpoint found on
phase a's first host, copied through this machine's cache to the teacher's host, published
there as nebula publishes checkpoints) to two student clusters that distil a smaller GPT with
DeepSpeed (examples/gpt/train.py under the automatic hook) and average through the relays.
Both jobs end SUCCEEDED with identical workers; every student batch came with soft labels;
the launch said what it copied; a second launch takes the checkpoint from the cache, and once
stopped resumes with the checkpoint its launch took, although phase a has run again since;
nothing is left running. The examples' specs, run shorter (fewer steps, shorter rounds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.jobs import CLI, REPO, job_processes

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "nebula-i"


def shortened(tmp_path: Path, name: str, steps: int, **change: Any) -> Path:
    """The example's spec with ``steps`` steps, rounds of 5 and a checkpoint every 10."""
    spec = yaml.safe_load((EXAMPLE / f"{name}.yaml").read_text())
    spec["workdir"] = str(REPO / "examples")
    spec["run"] = spec["run"].replace("--steps 300", f"--steps {steps}").replace(
        "--steps 200", f"--steps {steps}")
    spec["relay"]["sync"]["inner_steps"] = 5
    if "checkpoint" in spec:
        spec["checkpoint"]["every"] = 10
    spec.update(change)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def finished(cli: CLI, job: str) -> dict[str, Any]:
    st = json.loads(cli("status", job, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED", st
    assert st["final_parameters"]["identical"], st["final_parameters"]
    assert job_processes(st["id"]) == []
    return st


def test_phase_b_distils_from_the_checkpoint_phase_a_ended_with(cli: CLI,
                                                                tmp_path: Path) -> None:
    a = cli("launch", str(shortened(tmp_path, "phase_a", 20)), timeout=600)
    assert a.returncode == 0, a.stdout + a.stderr
    finished(cli, "nebula-i-a")

    checked = cli("validate", str(shortened(tmp_path, "phase_b", 10)), "--hosts", timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    shown = " ".join((checked.stdout + checked.stderr).split())
    assert "lab: would serve job nebula-i-a-" in shown and "checkpoint step20" in shown, shown

    b = cli("launch", str(shortened(tmp_path, "phase_b", 10)), timeout=600)
    assert b.returncode == 0, b.stdout + b.stderr
    said = " ".join((b.stdout + b.stderr).split())
    assert "lab: serves job nebula-i-a-" in said and "checkpoint step20 of cluster east" in said
    assert "copying job nebula-i-a-" in said, said  # the first time: downloaded
    assert "lab/lab1: teacher checkpoint step20 of job nebula-i-a-" in said
    st = finished(cli, "nebula-i-b")
    for student in ("cloud-a", "cloud-b"):
        soft = st["metrics"][student]
        assert soft.get("distill_batches") == 10, st["metrics"]
        assert soft["distill_without_labels"] == 0, soft
    assert st["metrics"]["lab"]["teacher_answers"] >= 20
    logs = cli("logs", "nebula-i-b", check=True).stdout
    assert "parameters from phase a's checkpoint" in logs, logs[-3000:]
    placed = list(cli.home.rglob("teacher-checkpoint/step20/COMPLETE"))
    assert placed, "the teacher's copy was not published with its marker"

    again = cli("launch", str(shortened(tmp_path, "phase_b", 400)), "--detach", timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "copying job" not in again.stdout + again.stderr  # the cache had it whole
    later = again.stdout.strip().splitlines()[-1]
    cli("stop", later, check=True, timeout=300)
    # phase a run again: the newest job of that name now holds another checkpoint (step10)
    a2 = cli("launch", str(shortened(tmp_path, "phase_a", 10)), timeout=600)
    assert a2.returncode == 0, a2.stdout + a2.stderr
    resumed = cli("resume", later, "--detach", timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    out = " ".join((resumed.stdout + resumed.stderr).split())
    assert "checkpoint step20 of cluster east" in out and "copying" not in out, out
    cli("stop", later, check=True, timeout=300)
    assert job_processes(later) == []
