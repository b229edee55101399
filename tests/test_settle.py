"""runtime.settle: a collective's tensor counts as held while gloo's worker still has it, and
settle() waits for the release (bounded). Two real gloo ranks in two processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RANK = r"""
import json, sys, time
import torch, torch.distributed as dist
from nebula_cli.runtime import settle
rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
out = {}
if rank == 0:
    t = settle.keep(torch.ones(4))
    work = dist.all_reduce(t, async_op=True)  # rank 1 joins only after a while
    out["held_while_in_flight"] = not settle._released(t)
    out["settled_early"] = settle.settle(timeout=0.2)  # gives up, drops the tensor
    work.wait()
    t = settle.keep(torch.ones(4))
    dist.all_reduce(t)
    out["settled"] = settle.settle(timeout=10)
    out["value"] = t.tolist()
    out["kept_after"] = len(settle._kept)
else:
    time.sleep(1.5)
    dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_settle_waits_until_gloo_lets_go_of_the_tensor(tmp_path: Path) -> None:
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(store)],
                              stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    result = json.loads(outs[0].strip().splitlines()[-1])
    assert result == {"held_while_in_flight": True, "settled_early": False, "settled": True,
                      "value": [2.0] * 4, "kept_after": 0}
