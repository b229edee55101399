"""The outer state on disk (runtime/outer_files.py): one file per rank, written as it lies, read
mapped; a newer format refused naming it; the single file of format 1 read as one piece. The
assembly across ranks and hosts runs on three gloo ranks in tests/runtime/test_shard.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

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
    (back,) = outer_files.read(tmp_path / "tag")
    assert back["format"] == outer_files.FORMAT and (back["lo"], back["hi"]) == (250_000, 500_000)
    assert torch.equal(back["theta_global"], big[250_000:500_000])


def test_a_format_newer_than_this_version_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "tag").mkdir()
    torch.save({"format": outer_files.FORMAT + 1, "theta_global": torch.zeros(2)},
               tmp_path / "tag" / outer_files.file_name(0))
    with pytest.raises(SyncError, match=f"format {outer_files.FORMAT + 1}, written by a newer"):
        outer_files.read(tmp_path / "tag")


def test_the_single_file_of_format_1_is_one_piece_covering_the_vector(tmp_path: Path) -> None:
    tag = tmp_path / "tag"
    tag.mkdir()
    theta, momentum = torch.arange(5.0), torch.full((5,), 0.5)
    torch.save({"mode": "diloco", "round": 7, "theta_global": theta, "anchor": None,
                "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True,
                          "momentum_buffer": momentum}}, tag / outer_files.LEGACY_FILE)
    parts = outer_files.read(tag)
    assert [p["format"] for p in parts] == [1]
    scalars, vectors = outer_files.assemble(parts, ShardMoves(Shard(5), None), contributes=True)
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
    _, vectors = outer_files.assemble(parts, ShardMoves(Shard(10), None), contributes=True)
    assert torch.equal(vectors["theta_global"], full)
    with pytest.raises(SyncError, match="lacks values .*theta_global from value 4 on"):
        outer_files.assemble([parts[0], parts[2]], ShardMoves(Shard(10), None),
                             contributes=True)
    with pytest.raises(SyncError, match="different formats, or some hold none"):
        outer_files.assemble([], ShardMoves(Shard(10), None), contributes=True)
