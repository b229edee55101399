"""A teacher's model from a nebula checkpoint (`runtime/distill/teacher_checkpoint.py`): real
DeepSpeed engines (2 CPU ranks over gloo) train a few steps and save as nebula publishes (a
``step<N>`` tag with its COMPLETE marker); the newest complete tag's module comes back as the
trained weights without ZeRO and, joined from the ranks' partitions, under ZeRO 3; an
incomplete tag is never taken; a folder without one, or without the variable, is said."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.gloo_ranks import run_ranks

from nebula_cli.config.distill_config import TEACHER_CHECKPOINT_ENV
from nebula_cli.runtime.distill.teacher_checkpoint import (
    TeacherCheckpointError,
    load_state_dict,
)

TRAIN = r"""
import json, os, sys, torch, deepspeed
rank, store, out, stage = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                     world_size=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
       "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
for step in range(3):
    torch.manual_seed(step + 10 * rank)
    loss = engine(torch.randn(2, 6)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    if step == 1:  # an older complete tag, and then the newest one
        engine.save_checkpoint(out, tag="step2", save_latest=False)
engine.save_checkpoint(out, tag="step3", save_latest=False)
if stage == 3:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = {k: v.detach().clone().tolist() for k, v in engine.module.state_dict().items()}
else:
    trained = {k: v.detach().clone().tolist() for k, v in engine.module.state_dict().items()}
loss = engine(torch.randn(2, 6)).pow(2).mean()  # one more step, in a tag never completed
engine.backward(loss)
engine.step()
engine.save_checkpoint(out, tag="step4", save_latest=False)
torch.distributed.barrier()
print(json.dumps(trained))
"""


@pytest.mark.parametrize("stage", [0, 3])
def test_the_newest_complete_tag_gives_the_trained_module(tmp_path: Path, stage: int,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    folder = tmp_path / "ckpt"
    trained, _ = run_ranks(TRAIN, tmp_path / "store", str(folder), str(stage), timeout=300)
    for tag in ("step2", "step3"):  # as nebula publishes: the marker last, private files
        (folder / tag / "COMPLETE").write_text("")
    for path in folder.rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)
    folder.chmod(0o700)
    monkeypatch.setenv(TEACHER_CHECKPOINT_ENV, str(folder))
    state = load_state_dict()
    assert sorted(state) == sorted(trained)
    for name, values in trained.items():
        assert torch.allclose(state[name].float(), torch.tensor(values), atol=1e-6), name
    (folder / "step4" / "COMPLETE").write_text("")  # once step 4 is complete, it is taken
    (folder / "step4" / "COMPLETE").chmod(0o600)
    assert any(not torch.equal(state[k], v) for k, v in load_state_dict(folder).items())


def test_a_folder_without_a_complete_checkpoint_or_the_variable_is_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TEACHER_CHECKPOINT_ENV, raising=False)
    with pytest.raises(TeacherCheckpointError, match=f"{TEACHER_CHECKPOINT_ENV} is not set"):
        load_state_dict()
    (tmp_path / "step5").mkdir()  # no marker: being written, or cut off
    with pytest.raises(TeacherCheckpointError, match="no complete checkpoint in"):
        load_state_dict(tmp_path)
