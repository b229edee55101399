"""Stand-ins for what the Checkpointer uses of a DeepSpeed engine and of an OuterSync, shared by
the checkpoint tests (and the scripts they run in subprocesses)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from nebula_cli.runtime import outer_files
from nebula_cli.runtime.shard import Shard, ShardMoves


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
    """What the Checkpointer uses of an OuterSync (``saved_part``, ``load_saved``): rank
    ``rank`` of ``world`` holding its 3 values of theta_global, saved and assembled through
    runtime/outer_files.py as OuterSync's (a world of several ranks: the default gloo group)."""

    def __init__(self, value: float, rank: int = 0, world: int = 1) -> None:
        self.theta = torch.full((3,), value)
        self.round = int(value)
        self.rank, self.world = rank, world

    def saved_part(self) -> dict[str, Any]:
        lo = 3 * self.rank
        return {"rank": self.rank, "world": self.world, "numel": 3 * self.world, "lo": lo,
                "hi": lo + self.theta.numel(), "theta_global": self.theta, "round": self.round}

    def load_saved(self, saved: outer_files.Saved, *, contributes: bool) -> None:
        moves = ShardMoves(Shard(self.theta.numel() * self.world, self.rank, self.world), None)
        got = outer_files.assemble(saved, moves, contributes=contributes)
        if got is not None:
            scalars, vectors = got
            self.theta, self.round = vectors["theta_global"], scalars["round"]
