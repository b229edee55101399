"""examples/hf: a Hugging Face Trainer script, unmodified (no nebula import; the Trainer
reaches DeepSpeed through accelerate), trains across two clusters through their relays: the
automatic hook wraps accelerate's deepspeed.initialize, rounds happen with both clusters, and
every worker ends with the same parameters."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.checkpoint_jobs import _records
from helpers.jobs import CLI, REPO, job_processes

pytest.importorskip("transformers", reason="the `hf` extra (the test command installs it)")
pytest.importorskip("accelerate", reason="the `hf` extra (the test command installs it)")

STEPS = 30


def launch_to_identical(cli: CLI, tmp_path: Path, spec: dict[str, Any]
                        ) -> tuple[str, list[dict[str, Any]]]:
    """Launch `spec` in the foreground: it succeeds with all 3 workers identical. The job's id
    and its workers' metric records."""
    spec_path = tmp_path / f"{spec['name']}.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    proc = cli("launch", str(spec_path), timeout=600)
    if proc.returncode != 0:
        ranks = "".join(f"--- {p}\n{p.read_text()[-3000:]}\n" for p in sorted(
            (cli.home / "jobs").glob("*/*/*/worker/logs/rank*.log")))
        pytest.fail(f"launch exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
                    f"\n{ranks}")
    assert "all 3 workers hold identical parameters" in proc.stdout
    (job_id,) = cli.job_ids()
    return job_id, _records(cli, job_id)


@pytest.mark.slow
def test_an_unmodified_trainer_script_trains_across_two_clusters(cli: CLI,
                                                                 tmp_path: Path) -> None:
    example = REPO / "examples" / "hf"
    assert "nebula" not in (example / "train.py").read_text().split('"""')[2]  # code, not doc
    work = tmp_path / "work"
    shutil.copytree(example, work, ignore=shutil.ignore_patterns("__pycache__", "hf-out"))
    spec = yaml.safe_load((example / "nebula.yaml").read_text())
    spec.update(workdir=str(work), run=f"python -u train.py --steps {STEPS}")
    job_id, recs = launch_to_identical(cli, tmp_path, spec)
    rounds = [r for r in recs if r.get("outer_round") is not None]
    assert len({r["outer_round"] for r in rounds}) >= STEPS // 10 - 1
    assert all(r["clusters_present"] == 2 for r in rounds)
    finals = [r for r in recs if r.get("final")]
    assert len(finals) == 3 and {r["step"] for r in finals} == {STEPS}
    assert all(r["cross_cluster_sync"] for r in finals)
    assert all(r["last_loss"] < r["first_loss"] - 1.0 for r in finals), finals
    logs = "".join(p.read_text() for p in (cli.home / "jobs" / job_id).glob(
        "*/*/worker/logs/rank0.log"))
    assert logs.count("eval loss ") == 2  # the script's own evaluate() after train()
    assert job_processes(job_id) == []


# the Trainer of examples/hf given NebulaCallback in code, as a user who prefers saying it would
WITH_CALLBACK = """\
import runpy, sys, transformers
from nebula_cli.integrations.hf import NebulaCallback

real_init = transformers.Trainer.__init__

def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    self.add_callback(NebulaCallback())

transformers.Trainer.__init__ = init
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
def test_lora_adapters_are_all_that_travels(cli: CLI, tmp_path: Path) -> None:
    """examples/lora: only the adapters train, so the relays carry adapter bytes per round
    (int8: about one byte each), a tenth of the model's, and every worker ends identical.
    Through NebulaCallback with the automatic hook off (runtime: {auto: false})."""
    pytest.importorskip("peft", reason="the `hf` extra (the test command installs it)")
    work = tmp_path / "work"
    shutil.copytree(REPO / "examples" / "hf", work,
                    ignore=shutil.ignore_patterns("__pycache__", "hf-out"))
    (work / "train_with_callback.py").write_text(WITH_CALLBACK)
    spec = yaml.safe_load((REPO / "examples" / "lora" / "nebula.yaml").read_text())
    spec.update(workdir=str(work), runtime={"auto": False},
                run="python -u train_with_callback.py --steps 20 --lora 8 "
                    f"--output-dir {tmp_path / 'out'}")
    job_id, recs = launch_to_identical(cli, tmp_path, spec)
    log = (cli.home / "jobs" / job_id / "east" / "e1" / "worker" / "logs" / "rank0.log").read_text()
    found = re.search(r"parameters: (\d+) trainable of (\d+)", log)
    assert found, log[-2000:]
    trainable, total = int(found[1]), int(found[2])
    assert trainable * 10 < total
    sent = {r["wan_bytes_sent"] for r in recs if r.get("outer_round") is not None}
    # a round's bytes: the adapters' int8 payload, its frames, and the heartbeats sent while it
    # lasted (more on a loaded machine); the whole model would be over 10 times as much
    assert sent and all(trainable <= b <= 1.5 * trainable for b in sent), (sent, trainable)
    finals = [r for r in recs if r.get("final")]  # the callback's on_train_end ended it
    assert len(finals) == 3 and {r["ended_by"] for r in finals} == {"trainer end"}, finals
