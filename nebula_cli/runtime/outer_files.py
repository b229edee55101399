"""The outer state on disk: one file per rank holding its own shard, read back at any rank count.

Each rank of a cluster writes its part of the outer state into its host's checkpoint tag,
``nebula_outer.rank<r>.pt``: its shard of theta_global, of the outer momentum and of overlap's
anchor (``VECTORS``, as they lie: written before training goes on, so no copy), with its shard's
bounds and the values every rank holds alike (the round, the cadence, the parameter names).
No rank gathers the vector to save it: the single file before (``LEGACY_FILE``, format 1) was
joined whole on the first rank of every host, two or three copies of the model there at every
save.

Loading (:func:`assemble`, every rank of the cluster at once): each rank maps the files of its
host's tag (``torch.load(mmap=True)``: pages of the file, not copies) and takes its new shard
from them. Where the ranks are where they were (the common case) every shard lies on its own
host and nothing crosses; otherwise (another rank count, another order of hosts) the first
rank of each host puts in the pieces its host holds, one max-reduce per rank and vector onto
the rank that owns that shard now (over -inf where a host holds nothing, so a piece two hosts
hold, a folder they share, comes back exact), with a count of who held each value beside it:
a shard's memory at a time. Whatever one host finds wrong (a value no file holds, files of
another job or version, another set of parameters) fails the load on every rank, that host
naming it: one all-reduce agrees first, so no rank is left waiting in a collective. A
checkpoint of format 1 loads as before (every rank takes its shard of the whole vector); a
format newer than :data:`FORMAT` is refused, naming it.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nebula_cli.runtime.outer import SyncError
from nebula_cli.runtime.settle import keep
from nebula_cli.runtime.shard import ShardMoves

FORMAT = 2
"""This version's format: one file per rank (1: one file with the whole vectors)."""
LEGACY_FILE = "nebula_outer.pt"
"""Format 1's single file (nebula before the sharded checkpoint; still read)."""
PREFIX, SUFFIX = "nebula_outer.rank", ".pt"
VECTORS = ("theta_global", "anchor", "momentum_buffer")
"""The per-element parts of the outer state: a shard of each in every rank's file."""


def file_name(rank: int) -> str:
    return f"{PREFIX}{rank}{SUFFIX}"


def write(folder: Path, part: dict[str, Any]) -> Path:
    """Write one rank's ``part`` (its ``rank`` names the file) into ``folder`` (0600)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / file_name(int(part["rank"]))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as fh:
        torch.save({"format": FORMAT, **{k: _alone(v) for k, v in part.items()}}, fh)
    return path


def _alone(value: Any) -> Any:
    """A tensor that is a view into more memory, copied (torch.save writes a view's whole
    storage); anything else as it is."""
    if isinstance(value, torch.Tensor) and (
            value.storage_offset() or not value.is_contiguous()
            or value.untyped_storage().nbytes() != value.numel() * value.element_size()):
        return value.clone()
    return value


def names(tag: Path) -> list[str]:
    """The outer state's files in a checkpoint tag (any format)."""
    try:
        return sorted(p.name for p in tag.iterdir()
                      if p.name == LEGACY_FILE or (p.name.startswith(PREFIX)
                                                   and p.name.endswith(SUFFIX)))
    except OSError:
        return []


@dataclass(frozen=True)
class Saved:
    """The outer state's files of one host's checkpoint tag, as read (or why they could not
    be: said on every rank once the cluster agrees, never raised on one host alone, which
    would leave the others waiting in a collective)."""

    parts: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None


def read(tag: Path) -> Saved:
    """The outer state's files of a checkpoint tag, mapped (tensors and plain values only:
    ``weights_only``); none when it has none. A file that holds more, cannot be read, or whose
    format is newer than this version reads is the result's ``problem``."""
    parts = []
    for name in names(tag):
        path = tag / name
        try:
            part = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as exc:
            return Saved(problem=f"the outer state {path} holds more than tensors and plain "
                                 f"values (nebula writes nothing else): not loaded ({exc})")
        except (OSError, RuntimeError, EOFError) as exc:  # (a cut or corrupt file)
            return Saved(problem=f"the outer state {path} cannot be read: {exc}")
        if not isinstance(part, dict):
            return Saved(problem=f"the outer state {path} is not one nebula wrote")
        fmt = int(part.get("format", 1))
        if fmt > FORMAT:
            return Saved(problem=f"the outer state {path} has format {fmt}, written by a "
                                 f"newer nebula (this one reads formats 1 to {FORMAT}): "
                                 "upgrade nebula on this host, or start without this "
                                 "checkpoint")
        parts.append({**part, "format": fmt})
    return Saved(parts)


def assemble(saved: Saved, moves: ShardMoves, *, contributes: bool, sharded: bool = True,
             param_names: list[str] | None = None
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor | None]] | None:
    """This rank's outer state from the files of its host (``saved``): the values every rank
    holds alike, and its shard of each of :data:`VECTORS` (None where the saved state had none,
    or every one when not ``sharded``: gradient mode keeps no vectors), in memory of its own;
    None when no host has any file (a checkpoint without an outer state). A collective: every
    rank of ``moves``' group calls it; ``contributes``: this rank puts its host's pieces in
    when they must cross (one rank per host). What one host finds wrong (its files, another
    job's, a different set of parameters) fails the load on every rank, that host naming it."""
    shard = moves.shard
    parts, problem = list(saved.parts), saved.problem
    fmts = {int(p["format"]) for p in parts}
    fmt = fmts.pop() if len(fmts) == 1 and (len(parts) == 1 or 1 not in fmts) else -1
    if problem is None and parts:
        problem = _problem(parts, fmt, shard.numel, sharded, param_names)
        if problem is None and fmt == 1:
            parts = [_as_shard(parts[0], shard.numel)]
    ok = problem is None and bool(parts)
    present = [ok and sharded and any(p.get(v) is not None for p in parts) for v in VECTORS]
    covered = ok and _covers(parts, shard.lo, shard.hi)
    # one all-reduce: each rank fit, files on every host or on none, one format everywhere,
    # every rank's shard at hand, which vectors the saved state has
    agreed = _min(moves, [int(problem is None), int(bool(parts)), -int(bool(parts)),
                          fmt if ok else FORMAT + 1, -fmt if ok else 0, int(covered),
                          *(-int(p) for p in present)])
    fit, everywhere, nowhere = agreed[0], agreed[1], agreed[2] == 0
    if fit and nowhere:
        return None
    if not fit:
        raise SyncError(problem or "another host of the cluster could not load its outer "
                        "state of this checkpoint (its log says why)")
    if not everywhere:
        raise SyncError(
            "the cluster's other hosts hold no outer state in this checkpoint where this one "
            "does" if parts else "this host's checkpoint has no outer state where the "
            "cluster's other hosts have one: a checkpoint of another job or version in this "
            "host's checkpoint directory")
    if agreed[3] != -agreed[4]:
        raise SyncError("the cluster's hosts hold this checkpoint's outer state in different "
                        f"formats (this one: {fmt}): a checkpoint of another version in one "
                        "host's checkpoint directory")
    if sharded and not -agreed[6]:
        raise SyncError("the checkpoint's outer state holds no theta_global (saved in "
                        "gradient mode?): start without it, or in the mode that saved it")
    scalars = {k: v for k, v in parts[0].items() if k not in VECTORS}
    vectors: dict[str, torch.Tensor | None] = {}
    missing: list[str] = []
    for name, there in zip(VECTORS, agreed[6:], strict=True):
        if not there:
            vectors[name] = None
        elif agreed[5]:  # every rank's shard lies on its own host
            vectors[name] = _local(parts, name, shard.lo, shard.hi)
        else:
            vectors[name] = _crossed(parts, name, moves, contributes, missing)
    if _min(moves, [int(not missing)])[0] == 0:
        raise SyncError("the checkpoint's outer state lacks values of the synced vector ("
                        f"{'; '.join(missing) or 'on another rank'}): a host's checkpoint "
                        "folder is missing or holds another checkpoint")
    return scalars, vectors


def _problem(parts: list[dict[str, Any]], fmt: int, numel: int, sharded: bool,
             param_names: list[str] | None) -> str | None:
    """What is wrong with one host's files for this rank (None: nothing)."""
    if fmt < 1:
        return ("this host's checkpoint holds outer state files of different formats: files "
                "of another job or version in its checkpoint directory")
    names = parts[0].get("param_names")
    if param_names is not None and names is not None and list(names) != list(param_names):
        return "outer sync state was saved for a different set of trainable parameters"
    saved = int(parts[0].get("numel", numel)) if fmt > 1 else numel
    if sharded and saved != numel:
        return f"outer sync state has {saved} values, expected {numel}"
    if fmt == 1:
        outer = parts[0].get("outer") or {}
        for name in VECTORS:
            t = outer.get(name) if name == "momentum_buffer" else parts[0].get(name)
            if sharded and isinstance(t, torch.Tensor) and t.numel() != numel:
                return (f"outer sync state has a vector {name} of {t.numel()} values, "
                        f"expected {numel}")
    return None


def _as_shard(whole: dict[str, Any], numel: int) -> dict[str, Any]:
    """A format-1 state (whole vectors; the momentum inside ``outer``) as one piece covering
    the vector."""
    outer = dict(whole.get("outer") or {})
    vectors = {"theta_global": whole.get("theta_global"), "anchor": whole.get("anchor"),
               "momentum_buffer": outer.pop("momentum_buffer", None)}
    return {**whole, **vectors, "outer": outer, "lo": 0, "hi": numel, "numel": numel}


def _covers(parts: list[dict[str, Any]], lo: int, hi: int) -> bool:
    """Whether the pieces of ``parts`` cover [lo, hi)."""
    at = lo
    for a, b in sorted((int(p["lo"]), int(p["hi"])) for p in parts):
        if a > at:
            break
        at = max(at, b)
    return at >= hi


def _pieces(parts: list[dict[str, Any]], name: str, lo: int, hi: int
            ) -> Iterator[tuple[int, torch.Tensor]]:
    """Each piece of vector ``name`` inside [lo, hi): (its offset from lo, its values)."""
    for p in parts:
        a, b = max(lo, int(p["lo"])), min(hi, int(p["hi"]))
        if a < b and p.get(name) is not None:
            yield a - lo, p[name].narrow(0, a - int(p["lo"]), b - a)


def _local(parts: list[dict[str, Any]], name: str, lo: int, hi: int) -> torch.Tensor:
    """[lo, hi) of vector ``name`` copied out of the pieces that hold it."""
    out = torch.zeros(hi - lo, dtype=torch.float32)
    for at, piece in _pieces(parts, name, lo, hi):
        out.narrow(0, at, piece.numel()).copy_(piece)
    return out


def _crossed(parts: list[dict[str, Any]], name: str, moves: ShardMoves, contributes: bool,
             missing: list[str]) -> torch.Tensor:
    """This rank's shard of vector ``name`` from the pieces every host's contributing rank
    holds: one max-reduce per rank, onto it, over -inf where a host holds nothing (a piece two
    hosts hold, a shared folder, comes back exact), and a sum of who held each value."""
    shard, mine = moves.shard, None
    for r in range(shard.world):
        lo, hi = shard.bounds(r)
        if lo >= hi:
            if r == shard.rank:
                mine = torch.empty(0, dtype=torch.float32)
            continue
        values = torch.full((hi - lo,), float("-inf"), dtype=torch.float32)
        count = torch.zeros(hi - lo, dtype=torch.int32)
        for at, piece in _pieces(parts, name, lo, hi) if contributes else ():
            place = values.narrow(0, at, piece.numel())
            torch.maximum(place, piece, out=place)
            count.narrow(0, at, piece.numel()).add_(1)
        if shard.world > 1:
            dst = moves._global(r)
            dist.reduce(keep(values), dst, op=dist.ReduceOp.MAX, group=moves.group)
            dist.reduce(keep(count), dst, group=moves.group)
        if r == shard.rank:
            held = count > 0
            if not bool(held.all()):
                first = int((~held).nonzero()[0])
                missing.append(f"{name} from value {lo + first} on")
            mine = values
        del values, count
    assert mine is not None
    return mine


def _min(moves: ShardMoves, values: list[int]) -> list[int]:
    """Each value's minimum over the cluster's ranks (one small all-reduce)."""
    t = torch.tensor(values, dtype=torch.int64)
    if moves.shard.world > 1:
        dist.all_reduce(keep(t), op=dist.ReduceOp.MIN, group=moves.group)
    return [int(v) for v in t.tolist()]

