"""config/run_command.py: a `run:` that starts its own launcher (torchrun, deepspeed,
accelerate launch, python -m torch.distributed.run) is found as a shell reads the command, not
by substring; the spec refuses it at `run`'s line with what to write instead (the launcher's
processes per node becoming `slots`), unless `run_launcher: true` says it is meant. Through the
real CLI: `nebula validate` exits 2 and names the line (REALWORLD: scripts whose README says
`torchrun ...` or `deepspeed ...`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from textwrap import dedent

import pytest

from nebula_cli.config.run_command import own_launcher
from nebula_cli.config.spec import load_spec
from nebula_cli.errors import SpecError


@pytest.mark.parametrize("run, launcher, script, per_node", [
    ("torchrun --nproc_per_node 2 train.py --lr 3e-4", "torchrun", ["train.py", "--lr", "3e-4"],
     2),
    ("torchrun --standalone --nproc-per-node=4 train.py", "torchrun", ["train.py"], 4),
    ("torchrun --nnodes 1 -m my.train --epochs 1", "torchrun", ["-m", "my.train", "--epochs",
                                                                "1"], None),
    ("deepspeed train.py --deepspeed ds.json", "deepspeed", ["train.py", "--deepspeed",
                                                             "ds.json"], None),
    ("deepspeed --num_gpus 8 --master_port 2950 train.py", "deepspeed", ["train.py"], 8),
    ("accelerate launch --num_processes 8 --num_machines 2 --mixed_precision bf16 run.py",
     "accelerate launch", ["run.py"], 4),
    ("python -m torch.distributed.run --nproc_per_node=2 train.py",
     "python -m torch.distributed.run", ["train.py"], 2),
    ("python3.11 -m torch.distributed.launch train.py", "python -m torch.distributed.launch",
     ["train.py"], None),
    ("cd src && OMP_NUM_THREADS=1 exec /opt/venv/bin/torchrun --nproc_per_node 2 t.py",
     "torchrun", ["t.py"], 2),
    ("pip list | grep torch; env -i PATH=/bin deepspeed x.py", "deepspeed", ["x.py"], None),
])
def test_launchers_are_found_with_what_they_start(run: str, launcher: str, script: list[str],
                                                   per_node: int | None) -> None:
    found = own_launcher(run)
    assert found is not None
    assert (found.launcher, found.script, found.per_node) == (launcher, script, per_node)


@pytest.mark.parametrize("run", [
    "python -u train.py",
    "python deepspeed_train.py --launcher torchrun",  # names, not launchers
    "echo torchrun; python train.py",
    "python -m torch.utils.collect_env && python train.py",
    "bash -c 'unbalanced",
    "accelerate config",
    "python -m deepspeed.launcher.launch_worker",  # not one of the launchers users write
])
def test_plain_commands_are_not_launchers(run: str) -> None:
    assert own_launcher(run) is None


def _spec(tmp_path: Path, run: str, extra: str = "") -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(dedent(f"""\
        name: demo
        run: {run}
        {extra}
        clusters:
          - name: east
            hosts: [{{host: e1, slots: 2}}]
        """))
    return path


def test_the_spec_refuses_a_launcher_at_its_line_with_what_to_write(tmp_path: Path) -> None:
    path = _spec(tmp_path, "torchrun --nproc_per_node 2 train.py --lr 3e-4")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (problem,) = info.value.problems
    assert (problem.line, problem.field) == (2, "run")
    assert "`torchrun` starts processes of its own" in problem.message
    assert "`run: python train.py --lr 3e-4`" in problem.message
    assert "`slots: 2` on each host (from its --nproc_per_node)" in problem.message
    assert "`run_launcher: true`" in problem.message


def test_run_launcher_true_accepts_it_as_written(tmp_path: Path) -> None:
    spec = load_spec(_spec(tmp_path, "deepspeed train.py", "run_launcher: true"))
    assert spec.run == "deepspeed train.py" and spec.run_launcher


def test_validate_exits_2_and_names_the_line(tmp_path: Path) -> None:
    path = _spec(tmp_path, "accelerate launch --num_processes 2 train.py")
    proc = subprocess.run([sys.executable, "-m", "nebula_cli", "validate", str(path)],
                          capture_output=True, text=True, timeout=60,
                          env={"COLUMNS": "300", "NO_COLOR": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{path}:2:" in proc.stderr and "`slots: 2` on each host" in proc.stderr
    assert "Traceback" not in proc.stderr
