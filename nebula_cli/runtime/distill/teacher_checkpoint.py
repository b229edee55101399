"""A teacher's model from a nebula checkpoint (`teacher: {from_job:}` or `{checkpoint:}`): the
newest complete tag of the folder ``NEBULA_TEACHER_CHECKPOINT`` names, as the state dict of
the module DeepSpeed trained, for the teacher's `run` script to load into the model it
rebuilds (a model that is not a Hugging Face one is rebuilt by that script)::

    model = GPT(config)
    model.load_state_dict(teacher_checkpoint.load_state_dict())
    distill.serve(lambda ids: model(ids))

Whatever the earlier job's parallelism: under ZeRO 1-3 the fp32 weights are joined from the
ranks' partitions (DeepSpeed's own ``zero_to_fp32``, which needs every rank's partition in the
tag: a cluster of one host, since each host keeps its own ranks'); without ZeRO the
module's own states (as trained: fp16 under fp16 training). The checkpoint is trusted as the
runtime's resume trusts one (`runtime.checkpoint.check_loadable`: DeepSpeed's files are read
with ``weights_only=False``, which runs code).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nebula_cli.config.distill_config import TEACHER_CHECKPOINT_ENV
from nebula_cli.runtime.checkpoint import check_loadable, complete_steps, tag_of
from nebula_cli.runtime.outer import SyncError

MODEL_STATES = "mp_rank_00_model_states.pt"
"""DeepSpeed's module states of a tag (model parallel rank 0)."""
ZERO_PARTITIONS = "*zero_pp_rank_*optim_states.pt"
"""DeepSpeed's per-rank ZeRO partitions (of the fp32 weights and the optimizer's states)."""


class TeacherCheckpointError(SyncError):
    """No model to serve in the checkpoint named, and why."""


def checkpoint_folder(path: str | os.PathLike[str] | None = None) -> Path:
    """``path``, or the folder ``NEBULA_TEACHER_CHECKPOINT`` names (set by nebula for a
    teacher of `teacher: {from_job:}` or `{checkpoint:}`)."""
    if path is None:
        named = os.environ.get(TEACHER_CHECKPOINT_ENV)
        if not named:
            raise TeacherCheckpointError(
                f"{TEACHER_CHECKPOINT_ENV} is not set: this process was not started by nebula "
                "for a teacher cluster with `teacher: {from_job: ...}` or `{checkpoint: ...}`")
        path = named
    return Path(path).expanduser()


def newest_tag(folder: Path) -> Path:
    """The newest complete tag (``step<N>`` with its COMPLETE marker) of ``folder``."""
    steps = complete_steps(folder)
    if not steps:
        raise TeacherCheckpointError(
            f"no complete checkpoint in {folder} (a complete one is a step<N> folder with "
            "its COMPLETE marker: the earlier job needs `checkpoint:`, and one saved)")
    return folder / tag_of(steps[-1])


def load_state_dict(path: str | os.PathLike[str] | None = None) -> dict[str, torch.Tensor]:
    """The trained module's state dict from the newest complete tag of ``path`` (default:
    ``NEBULA_TEACHER_CHECKPOINT``), on the CPU (see the module's docstring)."""
    folder = checkpoint_folder(path)
    tag = newest_tag(folder)
    check_loadable(folder, tag)
    if sorted(tag.glob(ZERO_PARTITIONS)):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        try:
            state = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag.name)
        except (ValueError, FileNotFoundError, AssertionError) as exc:
            raise TeacherCheckpointError(
                f"{tag}: its ZeRO partitions do not make the whole model ({exc}): every rank's "
                "partition must be in the tag, as in the checkpoint of a cluster of one host "
                "(each host keeps its own ranks')") from exc
        return {k: v.detach().cpu() for k, v in state.items()}
    states = tag / MODEL_STATES
    if not states.is_file():
        raise TeacherCheckpointError(f"{tag} holds no {MODEL_STATES}: not a DeepSpeed "
                                     "checkpoint")
    module = torch.load(states, map_location="cpu", weights_only=False).get("module")
    if not isinstance(module, dict) or not module:
        raise TeacherCheckpointError(f"{states} holds no module states")
    return {k: v.detach().cpu() for k, v in module.items() if isinstance(v, torch.Tensor)}
