"""Stand-ins for what the Checkpointer uses of a DeepSpeed engine and of an OuterSync, shared by
the checkpoint tests (and the scripts they run in subprocesses)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


class StandInEngine(torch.nn.Module):
    """What the Checkpointer uses of a DeepSpeedEngine: save_checkpoint, load_checkpoint,
    module, local_rank (DeepSpeed's files: one torch file per tag, `rank_file` named per rank
    as DeepSpeed names each rank's optimizer shard). `saved_to` lists each save's directory."""

    def __init__(self, seed: int = 0, local_rank: int = 0, save_delay: float = 0.0) -> None:
        super().__init__()
        self.save_delay = save_delay  # seconds before writing: a rank slower than its writer
        torch.manual_seed(seed)
        self.module = torch.nn.Linear(4, 2)
        self.global_steps = 0
        self.local_rank = local_rank
        self.saved_to: list[str] = []

    @property
    def rank_file(self) -> str:
        return f"mp_rank_{self.local_rank:02d}_model_states.pt"

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = True) -> bool:
        self.saved_to.append(save_dir)
        time.sleep(self.save_delay)
        where = Path(save_dir) / tag
        where.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.module.state_dict(), "global_steps": self.global_steps},
                   where / self.rank_file)
        return True

    def load_checkpoint(self, load_dir: str, tag: str) -> tuple[str | None, dict]:
        path = Path(load_dir) / tag / self.rank_file
        state = torch.load(path)
        self.module.load_state_dict(state["module"])
        self.global_steps = state["global_steps"]
        return str(path), {}


class StandInSync:
    """An OuterSync's state_dict / load_state_dict."""

    def __init__(self, value: float) -> None:
        self.theta = torch.full((3,), value)
        self.round = int(value)

    def state_dict(self, writer: bool = True) -> dict[str, Any] | None:
        return {"theta_global": self.theta.clone(), "round": self.round} if writer else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.theta, self.round = state["theta_global"], state["round"]
