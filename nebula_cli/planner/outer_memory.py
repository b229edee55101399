"""The memory the outer step takes, per process, before launch (`nebula plan`, `nebula validate
--params`, and `validate --hosts`' fit check).

The one place the per-role memory model lives: the outer step's copies of the synced fp32
vector per process role.

The ranks' outer state is sharded (`runtime/shard.py`, issue 42; measured 2026-12-02 with
OuterSync on 2 and 4 gloo ranks of one host, 20 M and 40 M parameters in 1 M-value layers, a
pretend relay, peak VmHWM above the same process before the sync): every rank other than 0 held
about 9 copies of its own shard at a round's peak (4.46 whole copies on 2 ranks, 2.24-2.31 on 4;
its shard of theta_global and of the momentum, the read, the delta, its shard of the average,
the 64 MiB runs of the write), rank 0 about 4 copies of its shard plus 2.3 of the whole vector
(the gathered delta, the average from the relay, the gathered state it publishes: 4.36 whole
copies on 2 ranks, 3.34 on 4). The old path held 5 whole copies on every rank (measured the
same way). Rank 0's hop makes no copy of the whole vector since (each round's delta joined in
the relay client's staging memory, the published state joined in one shared buffer), and the
relay keeps one round's average and its own chunks encoded: at 19 M, int8, in a real job
(`bench/scale.py --quick`), the relay held 8.0-8.2 whole copies (5 of them in shared memory),
rank 0 3.6-4.4, the other rank 2.9-3.3 of its shard plus the write's run. The relay is not
sharded yet. A checkpoint adds nothing: each rank writes its own shard as it lies
(`runtime/outer_files.py`; until 2026-12-03 each host's first rank joined theta_global, the
momentum and overlap's anchor to save them, up to 3 whole copies). Not modelled yet: under
ZeRO 3 every rank joins the whole vector to write it inside DeepSpeed's one gather (1 whole
copy).

The old path (issue 42, measured 2026-12-01 with `examples/gpt/train.py` widened to 1.3 M,
19 M and 85 M parameters, two clusters of one rank each, int8, 1 Gbit/s shaped link; one copy is
4 bytes x the synced parameters):

- the relay: about 7 copies at a round's peak above its idle size (the error-feedback residual,
  2-3 kept averages, the mapped contribution, transients; 12 at 1.3 M where the fixed costs
  dominate, 8 at 19 M, 7 at 85 M), plus the published outer parameters and momentum in shared
  memory (2 copies, memfd, in no process's RSS);
- a cluster's rank 0: about 7 copies of nebula's own (outer parameters, momentum, a staging
  buffer, the delta, the mapped average and two for the publish copy);
- every other rank: about 5 copies. `runtime/params.py` reads the **full** fp32 vector on every
  rank whatever the ZeRO stage (ZeRO 3: `safe_get_full_fp32_param` is an all-gather; ZeRO 1/2:
  the same getter gathers each parameter's partitions; ZeRO 0: the parameters are replicated)
  and every rank applies the outer optimizer to it (`runtime/sync.py`), so the 5 copies measured
  under ZeRO 3 hold under ZeRO 0/1/2 as well.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

FP32_BYTES = 4
"""Bytes of one element of the synced vector (the outer state is fp32)."""


class ProcessRole(enum.Enum):
    """A process the outer step runs in."""

    RELAY = "relay"
    RANK0 = "rank 0"
    RANK = "other ranks"


COPIES: dict[ProcessRole, float] = {ProcessRole.RELAY: 3.0, ProcessRole.RANK0: 4.0,
                                    ProcessRole.RANK: 9.0}
"""Copies of the process's shard in its own memory at a round's peak (the relay: its own memory
above its shared mappings in bench/scale.py at 19 M int8 on 2026-12-02, 232-248 MB: the
error-feedback residual, the encoded contribution and its records, the peer's, the per-chunk
transients; the ranks: measured as said above)."""

WHOLE_COPIES: dict[ProcessRole, float] = {ProcessRole.RELAY: 0.0, ProcessRole.RANK0: 3.0,
                                          ProcessRole.RANK: 0.0}
"""Copies of the whole vector besides: rank 0's hop to the relay, in shared memory the relay
maps (the staging memory each round's delta is joined in, and the published state, theta and
momentum, while it is joined: bench/scale.py, 229 MB at 19 M)."""

SHARED_COPIES: dict[ProcessRole, float] = {ProcessRole.RELAY: 4.0, ProcessRole.RANK0: 0.0,
                                           ProcessRole.RANK: 0.0}
"""Copies in shared memory (memfd) that the process maps and no other process here counts: the
relay's published outer parameters and momentum, and the averages of its last round and the
one it builds (its mapping of rank 0's staging memory is counted on rank 0)."""

FIXES = ("more ranks per cluster (each rank's shard shrinks)",
         "the relay on another host (`gateway:`; a Slurm cluster: `relay_on: login`)")
"""What makes the outer step fit with the settings nebula has (the outer state already lives
in host memory; fragments, which would shrink a round's share, are not built yet)."""


def shard_elements(params: int, ranks: int, role: ProcessRole) -> int:
    """The elements of the synced vector a process owns: a rank its shard (runtime/shard.py),
    the relay the whole vector (not sharded yet)."""
    if role is ProcessRole.RELAY:
        return params
    return -(-params // max(1, ranks))


@dataclass(frozen=True)
class ProcessMemory:
    """What the outer step takes in one process."""

    role: ProcessRole
    copies: float
    shard_bytes: int
    shared_bytes: int
    whole_copies: float = 0.0
    whole_bytes: int = 0

    @property
    def own_bytes(self) -> int:
        """In the process's own memory (its RSS)."""
        return int(self.copies * self.shard_bytes + self.whole_copies * self.whole_bytes)

    @property
    def total_bytes(self) -> int:
        return self.own_bytes + self.shared_bytes


def process_memory(params: int, ranks: int, role: ProcessRole) -> ProcessMemory:
    """The outer step's memory in a process of `role` in a cluster of `ranks` ranks syncing
    `params` parameters."""
    shard = shard_elements(params, ranks, role) * FP32_BYTES
    return ProcessMemory(role, COPIES[role], shard, int(SHARED_COPIES[role] * shard),
                         WHOLE_COPIES[role], params * FP32_BYTES)


def cluster_memory(params: int, ranks: int) -> list[ProcessMemory]:
    """Each role a cluster of `ranks` ranks runs: its relay, rank 0, and the other ranks if any."""
    roles = [ProcessRole.RELAY, ProcessRole.RANK0] + ([ProcessRole.RANK] if ranks > 1 else [])
    return [process_memory(params, ranks, role) for role in roles]


def host_need(params: int, ranks: int, host_ranks: int, first_rank: int,
              relay: bool) -> int:
    """Bytes the outer step takes on one host of a cluster: its `host_ranks` ranks from
    `first_rank` on, and the relay if it runs there."""
    total = 0
    for rank in range(first_rank, first_rank + host_ranks):
        role = ProcessRole.RANK0 if rank == 0 else ProcessRole.RANK
        total += process_memory(params, ranks, role).total_bytes
    if relay:
        total += process_memory(params, ranks, ProcessRole.RELAY).total_bytes
    return total


def refusal(where: str, need: int, have: int, params: int) -> str | None:
    """The problem with a host that has `have` bytes for an outer step needing `need`, or None
    when it fits."""
    if need <= have:
        return None
    return (f"{where}: the outer step of {params:,} parameters needs {gib(need)} here, the host "
            f"has {gib(have)}; use {', '.join(FIXES)}, or a host with more memory")


def gib(n: int, unit: bool = True) -> str:
    """`n` bytes in GiB, two decimals."""
    return f"{n / (1 << 30):.2f}" + (" GiB" if unit else "")


@dataclass(frozen=True)
class ClusterMemory:
    """A cluster's processes and the outer step's memory in each."""

    cluster: str
    ranks: int
    processes: list[ProcessMemory]

    def to_json(self) -> dict[str, object]:
        return {"cluster": self.cluster, "ranks": self.ranks,
                "processes": [{"role": p.role.value, "copies": p.copies,
                               "shard_bytes": p.shard_bytes, "whole_copies": p.whole_copies,
                               "own_bytes": p.own_bytes,
                               "shared_bytes": p.shared_bytes, "total_bytes": p.total_bytes}
                              for p in self.processes]}


def job_memory(params: int, clusters: dict[str, int]) -> list[ClusterMemory]:
    """Each cluster (name: its ranks) with its processes' outer-step memory."""
    return [ClusterMemory(name, ranks, cluster_memory(params, ranks))
            for name, ranks in clusters.items()]
