"""Shards of the synced vector (runtime/shard.py): their bounds, the cluster's shard collectives
on three gloo ranks, and OuterSync with its outer state sharded over three ranks ending on the
same parameters, published state and checkpointed state as one rank holding all of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers.gloo_ranks import run_ranks
from helpers.jobs import CLI
from helpers.quickstart import check_finished_job, metric_records, short_spec
from helpers.sync_reference import (
    CFG,
    LR,
    MU,
    TRAINABLE,
    ScriptedAverager,
    few_trainable_model,
    plain_step,
    small_model,
)

from nebula_cli.runtime import outer_files
from nebula_cli.runtime.shard import Shard
from nebula_cli.runtime.sync import OuterSync

TESTS = str(Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("numel,world", [(10, 3), (12, 3), (2, 3), (1, 4), (0, 2), (83, 1)])
def test_every_element_has_one_owner_and_every_shard_one_padded_size(numel: int, world: int
                                                                      ) -> None:
    shards = [Shard(numel, r, world) for r in range(world)]
    owned = [i for s in shards for i in range(s.lo, s.hi)]
    assert owned == list(range(numel))  # contiguous, in rank order, each element once
    assert all(s.length <= s.size for s in shards)
    assert all(s.size == -(-numel // world) for s in shards)
    full = torch.arange(float(numel))
    assert torch.equal(torch.cat([s.of(full) for s in shards]), full)


MOVES = r"""
import json, sys
import torch, torch.distributed as dist
from nebula_cli.runtime.shard import Shard, ShardMoves
rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=3)
out = {}
for numel in (10, 12, 2):
    shard = Shard(numel, rank, 3)
    moves = ShardMoves(shard, None)
    full = torch.arange(float(numel)) + 100
    mine = shard.of(full) * (rank + 1)  # each rank's part, made recognisable
    got = moves.gather(mine)
    lent = torch.full((numel,), -1.0) if rank == 0 else None  # the relay hop's memory
    if lent is not None:
        shard.of(lent).copy_(mine)  # rank 0's part made in its place (no copy to join it)
    into = moves.gather(mine if lent is None else shard.of(lent), out=lent)
    out[numel] = {
        "into": None if into is None else [into.tolist(), into.data_ptr() == lent.data_ptr()],
        "gathered": None if got is None else got.tolist(),
        "scattered": moves.scatter(full if rank == 0 else None).tolist(),
        "all": moves.all_gather(mine).tolist(),
        "squares": moves.sum_squares(mine, None),
    }
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_gather_scatter_and_all_gather_of_uneven_shards_on_three_ranks(tmp_path: Path) -> None:
    said = run_ranks(MOVES, tmp_path / "store", ranks=3)
    for numel in (10, 12, 2):
        full = torch.arange(float(numel)) + 100
        shards = [Shard(numel, r, 3) for r in range(3)]
        joined = torch.cat([s.of(full) * (s.rank + 1) for s in shards]).tolist()
        for rank, out in enumerate(r[str(numel)] for r in said):
            assert out["gathered"] == (joined if rank == 0 else None)
            assert out["into"] == ([joined, True] if rank == 0 else None)  # in the memory lent
            assert out["scattered"] == shards[rank].of(full).tolist()
            assert out["all"] == joined
            assert out["squares"] == [pytest.approx(sum(x * x for x in joined)), 0.0]


SYNC = r"""
import json, sys
import torch, torch.distributed as dist
from pathlib import Path
rank, store_path, tests, overlap, saved_in, lends = (int(sys.argv[1]), sys.argv[2], sys.argv[3],
                                                     sys.argv[4] == "1", sys.argv[5],
                                                     sys.argv[6] == "1")
sys.path.insert(0, tests)
from helpers.sync_reference import (CFG, LR, MU, LendingAverager, ScriptedAverager, plain_step,
                                    small_model)
from nebula_cli.runtime import outer_files
from nebula_cli.runtime.outer import SyncError
from nebula_cli.runtime.sync import OuterSync
dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=3)
model = small_model()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
averager = (LendingAverager() if lends else ScriptedAverager()) if rank == 0 else None
sync = OuterSync(model, config=CFG, averager=averager, inner_steps=1, outer_lr=LR,
                 outer_momentum=MU, mode="diloco", overlap=overlap, overlap_steps=1)
for step in range(1, 7):
    plain_step(model, opt, step)  # the same batch on every rank: the ranks stay identical
    sync.after_step(step)
sync.flush()
folders = Path(saved_in)
outer_files.write(folders / f"host{rank}", sync.saved_part())  # each rank on a host of its own
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
out = {"params": flat.tolist(), "theta": sync.full_theta_global().tolist(),
       "shard": [sync.shard.lo, sync.shard.hi],
       "published": [] if averager is None else [[r, t.tolist()] for r, t in averager.published],
       "in_lent": getattr(averager, "in_lent", None),
       "published_in_lent": getattr(averager, "published_in_lent", None)}
dist.barrier()

def load(hosts, contributes=True):
    parts = [p for h in hosts for p in outer_files.read(folders / h).parts]
    try:
        sync.load_saved(outer_files.Saved(parts), contributes=contributes)
    except SyncError as exc:
        return str(exc)
    return [sync.theta_global.tolist(), sync.outer.momentum_buffer.tolist(), sync.round]

out["as_saved"] = load([f"host{rank}"])  # every shard where it was: nothing crosses
out["swapped"] = load([f"host{(3 - rank) % 3}"])  # ranks 1 and 2 on each other's hosts
out["shared"] = load([["host1", "host2"], ["host1", "host2"], ["host0"]][rank])  # (1 twice)
out["missing"] = load([["host0"], ["host0"], ["host2"]][rank])  # rank 1's file nowhere
out["one_rank"] = load(["one"])  # what one rank holding it all saved
out["legacy"] = load(["legacy"])  # the single file of the version before
sync.close()
dist.destroy_process_group()
print(json.dumps(out))
"""


def _one_rank(overlap: bool) -> tuple[torch.Tensor, OuterSync, ScriptedAverager]:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = ScriptedAverager()
    sync = OuterSync(model, config=CFG, averager=averager, inner_steps=1, outer_lr=LR,
                     outer_momentum=MU, mode="diloco", overlap=overlap, overlap_steps=1)
    for step in range(1, 7):
        plain_step(model, opt, step)
        sync.after_step(step)
    sync.flush()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), sync, averager


@pytest.mark.parametrize("lends", [False, True], ids=["own", "lent"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_three_ranks_with_sharded_outer_state_end_as_one_rank_holding_it_all(
        tmp_path: Path, overlap: bool, lends: bool) -> None:
    """83 trainable values over 3 ranks (28, 28, 27: the first layer's weight split between
    ranks 0 and 1): the parameters, theta_global and the state published for clusters that fall
    behind are those of one rank holding the whole outer state. Each rank saves only its shard;
    they load back where they were, with ranks on each other's hosts, from a folder two hosts
    share, from what one rank saved (and three ranks' files on one), and from the previous
    version's single file; a shard no host holds fails the load on every rank. ``lent``: rank
    0's averager lends the memory it sends from (the relay client's): every contribution and
    published state is joined there."""
    params, ref, averager = _one_rank(overlap)
    saved = tmp_path / "saved"
    outer_files.write(saved / "one", ref.saved_part())
    buf = ref.outer.momentum_buffer
    legacy = saved / "legacy"  # what the version before wrote: every vector whole, in one file
    legacy.mkdir(parents=True)
    torch.save({"mode": "diloco", "round": ref.round, "grad_round": 0,
                "last_round_step": ref._last_round_step, "theta_global": ref.theta_global,
                "anchor": ref._anchor, "param_names": list(ref.param_names),
                "outer": {"lr": LR, "momentum": MU, "nesterov": True, "momentum_buffer": buf},
                "cadence": ref.cadence.state_dict(), "step": 6},
               legacy / outer_files.LEGACY_FILE)
    said = run_ranks(SYNC, tmp_path / "store", TESTS, "1" if overlap else "0", str(saved),
                     "1" if lends else "0", ranks=3, timeout=180)
    if lends:  # (a contribution or state not joined there would show its NaN on every rank)
        assert said[0]["in_lent"] == [True] * len(averager.sent)
        assert said[0]["published_in_lent"] == [True] * 6
    assert [s["shard"] for s in said] == [[0, 28], [28, 56], [56, TRAINABLE]]
    for s in said:
        assert s["params"] == params.tolist()
        assert s["theta"] == ref.theta_global.tolist()
        lo, hi = s["shard"]
        mine = [ref.theta_global[lo:hi].tolist(), buf[lo:hi].tolist(), ref.round]
        for how in ("as_saved", "swapped", "shared", "one_rank", "legacy"):
            assert s[how] == mine, how
        assert "lacks values" in s["missing"]  # on every rank, none left waiting
    assert "theta_global from value 28 on" in said[1]["missing"]  # the rank it was missing on
    assert said[0]["published"] == [[r, t.tolist()] for r, t in averager.published]
    assert len(averager.published) == 6
    one = OuterSync(small_model(), config=CFG, averager=ScriptedAverager(), inner_steps=1,
                    outer_lr=LR, outer_momentum=MU, mode="diloco")
    one.load_saved(outer_files.Saved([p for r in range(3)
                                      for p in outer_files.read(saved / f"host{r}").parts]),
                   contributes=True)  # what three ranks saved, on one
    assert torch.equal(one.theta_global, ref.theta_global)
    assert torch.equal(one.outer.momentum_buffer, buf) and one.round == ref.round
    one.close()
    ref.close()


FEW = r"""
import json, sys
import torch, torch.distributed as dist
rank, store_path, tests, overlap = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
saved_in = sys.argv[5]
sys.path.insert(0, tests)
from pathlib import Path
from helpers.sync_reference import (CFG, LR, MU, LendingAverager, few_trainable_model,
                                    plain_step)
from nebula_cli.runtime import outer_files
from nebula_cli.runtime.sync import OuterSync
dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=4)
model = few_trainable_model()
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
averager = LendingAverager() if rank == 0 else None
sync = OuterSync(model, config=CFG, averager=averager, inner_steps=1, outer_lr=LR,
                 outer_momentum=MU, mode="diloco", overlap=overlap, overlap_steps=1)
for step in range(1, 6):
    plain_step(model, opt, step)
    sync.after_step(step)
sync.flush()
outer_files.write(Path(saved_in), sync.saved_part())  # the empty shard's file too
out = {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
       "shard": [sync.shard.lo, sync.shard.hi], "theta": sync.full_theta_global().tolist(),
       "published": [] if averager is None else [[r, t.tolist()] for r, t in averager.published]}
sync.close()
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_handful_of_trainable_values_on_four_ranks_one_of_them_owning_none(
        tmp_path: Path, overlap: bool) -> None:
    """A LoRA-like job: 3 trainable values of one tensor over 4 ranks (1, 1, 1 and an empty
    shard): the parameters, theta_global, the published and the checkpointed state are those
    of one rank holding the whole outer state, the empty rank taking part in every move."""
    model = few_trainable_model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    averager = ScriptedAverager()
    ref = OuterSync(model, config=CFG, averager=averager, inner_steps=1, outer_lr=LR,
                    outer_momentum=MU, mode="diloco", overlap=overlap, overlap_steps=1)
    for step in range(1, 6):
        plain_step(model, opt, step)
        ref.after_step(step)
    ref.flush()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    saved = tmp_path / "saved"
    said = run_ranks(FEW, tmp_path / "store", TESTS, "1" if overlap else "0", str(saved),
                     ranks=4, timeout=180)
    assert [s["shard"] for s in said] == [[0, 1], [1, 2], [2, 3], [3, 3]]
    for s in said:
        assert s["params"] == params and s["theta"] == ref.theta_global.tolist()
    parts = outer_files.read(saved)
    assert [(p["lo"], p["hi"], p["theta_global"].numel()) for p in parts.parts] == [
        (0, 1, 1), (1, 2, 1), (2, 3, 1), (3, 3, 0)]
    one = OuterSync(few_trainable_model(), config=CFG, averager=ScriptedAverager(),
                    inner_steps=1, outer_lr=LR, outer_momentum=MU, mode="diloco")
    one.load_saved(parts, contributes=True)  # the four ranks' checkpoint on one
    assert torch.equal(one.theta_global, ref.theta_global)
    one.close()
    assert said[0]["published"] == [[r, t.tolist()] for r, t in averager.published]
    assert len(averager.published) >= 4
    ref.close()


def test_clusters_of_two_and_three_ranks_zero1_beside_zero3_end_identical(
        cli: CLI, tmp_path: Path) -> None:
    """examples/gpt through `nebula launch`: east of 2 ranks under ZeRO 1, west of 3 under
    ZeRO 3, each rank holding its own shard of its cluster's outer state (a different cut on
    each cluster): every round has both clusters and all five ranks end with the same
    parameters."""
    spec_path = short_spec(tmp_path, clusters={"east": ["e1"], "west": ["w1"]}, steps=20,
                           inner=10, name="zeromix")
    spec = yaml.safe_load(spec_path.read_text())
    spec.pop("deepspeed")  # one job-wide config: each cluster names its own instead
    base = json.loads((Path(TESTS).parent / "examples/gpt/ds_config.json").read_text())
    for cluster, ranks, stage in zip(spec["clusters"], (2, 3), (1, 3), strict=True):
        ds = tmp_path / f"ds_zero{stage}.json"
        ds.write_text(json.dumps({**base, "zero_optimization": {"stage": stage}}))
        cluster["hosts"][0]["slots"] = ranks
        cluster["env"] = {"NEBULA_DS_CONFIG": str(ds)}
    spec_path.write_text(yaml.safe_dump(spec))
    job_id = cli("launch", str(spec_path), "--detach", check=True).stdout.strip()
    follow = cli("logs", job_id, "-f", timeout=900)
    assert follow.returncode == 0, follow.stderr
    check_finished_job(cli, job_id, workers=5, rounds=2)
    banners = [line for line in follow.stdout.splitlines() if "| gpt: " in line
               and " parameters, " in line]
    assert sorted(b.split(" | ")[0] + ":" + b.split(" rank(s) ")[1].split(",")[0]
                  for b in banners) == ["east/e1/0:(ZeRO 1)", "west/w1/0:(ZeRO 3)"], banners
    assert all("2 rank(s)" in b for b in banners if b.startswith("east"))
    assert all("3 rank(s)" in b for b in banners if b.startswith("west"))
    finals = [r for r in metric_records(cli.home, job_id) if r.get("final")]
    assert sorted((r["cluster"], r.get("rank")) for r in finals) == [
        ("east", 0), ("east", 1), ("west", 0), ("west", 1), ("west", 2)], finals
