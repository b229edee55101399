"""runtime/cluster_share.py: rank 0's round outcome reaches every rank of the cluster the same,
the next round (NextRound) whole, through one header the RoundHeader encodes. Two real gloo
ranks in two processes, and the header on its own."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.gloo_ranks import run_ranks

from nebula_cli.relay.protocol.next_round import WHY_CHARS, NextRound
from nebula_cli.relay.protocol.pacing import CODEC_CHARS
from nebula_cli.runtime.cluster_share import HEADER_BYTES, ClusterShare, RoundHeader
from nebula_cli.runtime.outer import SyncError

RANK = r"""
import json, sys
from types import SimpleNamespace
import torch, torch.distributed as dist
from nebula_cli.relay.protocol.next_round import NextRound
from nebula_cli.runtime.cluster_share import ClusterShare
from nebula_cli.runtime.outer import SyncError
rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
share = ClusterShare(rank, 2, None, 4)
result = SimpleNamespace(tensor=torch.arange(4.0), present=["a", "b"], round_id=3,
                         bytes_sent=10, bytes_received=20, seconds=0.5, codec="int8",
                         next=NextRound(h=7, merge=2, codec="topk", why="ü: why"))
out = share.share(3, result if rank == 0 else None, None)
said = {"next": [out.next.h, out.next.merge, out.next.codec, out.next.why],
        "codec": out.codec, "present": out.present, "round": out.round_id,
        "bytes": [out.bytes_sent, out.bytes_received], "seconds": out.seconds,
        "avg": out.avg.tolist(), "state": out.state}
try:
    share.share(4, None, RuntimeError("boom") if rank == 0 else None)
except SyncError as exc:
    said["error"] = str(exc)
dist.destroy_process_group()
print(json.dumps(said))
"""


def test_every_rank_gets_rank_0s_outcome_and_next_round(tmp_path: Path) -> None:
    said = run_ranks(RANK, tmp_path / "store")
    for s in said:
        assert s["next"] == [7, 2, "topk", "ü: why"] and s["codec"] == "int8"
        assert s["present"] == 2 and s["round"] == 3 and s["bytes"] == [10, 20]
        assert s["seconds"] == 0.5 and s["avg"] == [0.0, 1.0, 2.0, 3.0] and s["state"] is None
    assert said[0]["error"] == "outer round 4 failed: boom"
    assert said[1]["error"] == "outer round 4 failed on this cluster's rank 0 (see its log)"


def test_the_header_round_trips_and_its_longest_form_fits() -> None:
    head = RoundHeader(True, 3, 2**40, 7, 1.25, 12, True, False, "bf16",
                       NextRound(h=100, merge=3, codec="int8", why="slowest"))
    t = head.to_tensor()
    assert t.dtype == torch.uint8 and t.numel() == HEADER_BYTES
    assert RoundHeader.from_tensor(t) == head
    longest = RoundHeader(True, 2**31, 2**62, 2**62, 1e300, 2**62, True, True,
                          "\u2603" * CODEC_CHARS,
                          NextRound(h=2**62, merge=2**62, codec="\u2603" * CODEC_CHARS,
                                    why="\u2603" * WHY_CHARS))
    assert RoundHeader.from_tensor(longest.to_tensor()) == longest
    assert RoundHeader.from_tensor(torch.zeros(HEADER_BYTES, dtype=torch.uint8)) == \
        RoundHeader()  # nothing broadcast: not ok


def test_one_rank_applies_what_the_averager_said() -> None:
    share = ClusterShare(0, 1, None, 3)
    nxt = NextRound(h=5, why="because")
    res = SimpleNamespace(tensor=torch.ones(3), present=["a"], round_id=0, bytes_sent=1,
                          bytes_received=2, seconds=0.1, next=nxt,
                          global_state=torch.full((3,), 2.0), global_momentum=torch.ones(3))
    out = share.share(0, res, None)
    assert out.next == nxt and out.state is not None and out.momentum is not None
    assert out.avg is None and out.codec == ""
    plain = SimpleNamespace(tensor=torch.ones(3), present=["a"], round_id=1, bytes_sent=1,
                            bytes_received=2, seconds=0.1)  # an averager that says nothing
    assert share.share(1, plain, None).next == NextRound()
    with pytest.raises(SyncError, match="the averager returned a average of 2 values"):
        share.share(2, SimpleNamespace(**{**vars(plain), "tensor": torch.ones(2)}), None)
    with pytest.raises(SyncError, match="a round header of"):  # told to every rank as failed
        share.share(3, SimpleNamespace(**{**vars(plain), "codec": "x" * HEADER_BYTES}), None)
