"""The outer state on disk (runtime/outer_files.py): one file per rank, written as it lies, read
mapped; a newer format refused naming it; the single file of format 1 read as one piece. The
assembly across ranks and hosts runs on three gloo ranks in tests/runtime/test_shard.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from helpers.gloo_ranks import run_ranks

from nebula_cli.runtime import outer_files
from nebula_cli.runtime.outer import SyncError
from nebula_cli.runtime.shard import Shard, ShardMoves


def _part(rank: int, world: int, values: torch.Tensor, numel: int) -> dict:
    shard = Shard(numel, rank, world)
    return {"rank": rank, "world": world, "numel": numel, "lo": shard.lo, "hi": shard.hi,
            "theta_global": values, "anchor": None, "momentum_buffer": None, "round": 4}


def test_a_shard_that_is_a_view_is_written_alone_private_and_read_back_mapped(
        tmp_path: Path) -> None:
    """torch.save writes a view's whole storage: a shard cut from a larger buffer (a ZeRO flat
    group) is written alone, 0600, and read back as a mapping of the file."""
    big = torch.arange(1_000_000, dtype=torch.float32)
    path = outer_files.write(tmp_path / "tag", _part(1, 4, big[250_000:500_000], 1_000_000))
    assert path.name == "nebula_outer.rank1.pt"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.stat().st_size < 1_100_000  # 250,000 values, not the 4 MB buffer
    (back,) = outer_files.read(tmp_path / "tag").parts
    assert back["format"] == outer_files.FORMAT and (back["lo"], back["hi"]) == (250_000, 500_000)
    assert torch.equal(back["theta_global"], big[250_000:500_000])


def test_a_format_newer_than_this_version_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "tag").mkdir()
    torch.save({"format": outer_files.FORMAT + 1, "theta_global": torch.zeros(2)},
               tmp_path / "tag" / outer_files.file_name(0))
    saved = outer_files.read(tmp_path / "tag")
    assert saved.parts == [] and f"format {outer_files.FORMAT + 1}, written by a newer" in (
        saved.problem or "")
    with pytest.raises(SyncError, match="written by a newer nebula"):  # said once agreed
        outer_files.assemble(saved, ShardMoves(Shard(2), None), contributes=True)


def test_the_single_file_of_format_1_is_one_piece_covering_the_vector(tmp_path: Path) -> None:
    tag = tmp_path / "tag"
    tag.mkdir()
    theta, momentum = torch.arange(5.0), torch.full((5,), 0.5)
    torch.save({"mode": "diloco", "round": 7, "theta_global": theta, "anchor": None,
                "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True,
                          "momentum_buffer": momentum}}, tag / outer_files.LEGACY_FILE)
    parts = outer_files.read(tag)
    assert [p["format"] for p in parts.parts] == [1]
    scalars, vectors = outer_files.assemble(parts, ShardMoves(Shard(5), None),
                                            contributes=True)
    assert scalars["round"] == 7 and "momentum_buffer" not in scalars["outer"]
    assert torch.equal(vectors["theta_global"], theta) and vectors["anchor"] is None
    assert torch.equal(vectors["momentum_buffer"], momentum)
    with pytest.raises(SyncError, match="has a vector theta_global of 5 values, expected 6"):
        outer_files.assemble(parts, ShardMoves(Shard(6), None), contributes=True)


def test_pieces_of_another_rank_count_make_one_rank_whole_and_a_gap_is_named(
        tmp_path: Path) -> None:
    full = torch.arange(10.0)
    parts = [{"format": 2, **_part(r, 3, Shard(10, r, 3).of(full).clone(), 10)}
             for r in range(3)]
    one = ShardMoves(Shard(10), None)
    _, vectors = outer_files.assemble(outer_files.Saved(parts), one, contributes=True)
    assert torch.equal(vectors["theta_global"], full)
    with pytest.raises(SyncError, match="lacks values .*theta_global from value 4 on"):
        outer_files.assemble(outer_files.Saved([parts[0], parts[2]]), one, contributes=True)
    assert outer_files.assemble(outer_files.Saved(), one, contributes=True) is None  # none
    with pytest.raises(SyncError, match="different set of trainable parameters"):
        outer_files.assemble(outer_files.Saved([{**p, "param_names": ["a"]} for p in parts]),
                             one, contributes=True, param_names=["b"])
    with pytest.raises(SyncError, match="has 10 values, expected 12"):
        outer_files.assemble(outer_files.Saved(parts), ShardMoves(Shard(12), None),
                             contributes=True)
    gradient = [{**p, "theta_global": None, "lo": 0, "hi": 0} for p in parts]
    with pytest.raises(SyncError, match="holds no theta_global"):  # a gradient-mode state
        outer_files.assemble(outer_files.Saved(gradient), one, contributes=True)
    scalars, vectors = outer_files.assemble(outer_files.Saved(gradient), one,
                                            contributes=True, sharded=False)
    assert scalars["round"] == 4 and set(vectors.values()) == {None}


RANKS = r"""
import json, sys
import torch, torch.distributed as dist
from nebula_cli.runtime import outer_files
from nebula_cli.runtime.outer import SyncError
from nebula_cli.runtime.shard import Shard, ShardMoves
rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=3)
numel = 1000
full = torch.randn(numel, generator=torch.Generator().manual_seed(5))
moves = ShardMoves(Shard(numel, rank, 3), None)
pieces = [{"format": 2, "rank": r, "world": 3, "numel": numel, "lo": Shard(numel, r, 3).lo,
           "hi": Shard(numel, r, 3).hi, "theta_global": Shard(numel, r, 3).of(full).clone(),
           "round": 3} for r in range(3)]
out = {}
# a folder three hosts share: rank 1's piece held by every rank, rank 0's only by rank 2
held = [[1, 2], [1, 2], [0, 1, 2]][rank]
got = outer_files.assemble(outer_files.Saved([pieces[i] for i in held]), moves,
                           contributes=True)
out["shared"] = torch.equal(got[1]["theta_global"], moves.shard.of(full))
# one host's folder holds another job's checkpoint (another model size): every rank fails
other = [pieces[rank]] if rank != 1 else [{**pieces[1], "numel": 6}]
try:
    outer_files.assemble(outer_files.Saved(other), moves, contributes=True)
    out["other_job"] = None
except SyncError as exc:
    out["other_job"] = str(exc)
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_on_three_ranks_a_shared_folder_comes_back_exact_and_one_bad_host_fails_them_all(
        tmp_path: Path) -> None:
    """A piece held by three hosts (a folder they share) comes back bit for bit (a max, not a
    mean); a host whose folder holds another job's checkpoint fails the load on every rank at
    once, naming why on that host, instead of leaving the others in a collective."""
    said = run_ranks(RANKS, tmp_path / "store", ranks=3, timeout=60)
    assert [s["shared"] for s in said] == [True, True, True]
    assert "has 6 values, expected 1000" in said[1]["other_job"]
    assert all("another host of the cluster could not load" in said[r]["other_job"]
               for r in (0, 2))
