"""Clusters whose hosts come from a scheduler's allocation, at launch and after: the job's plan
is made as for SSH hosts, with the allocations' nodes as the clusters' hosts.

`allocating_clusters` (those whose scheduler allocates), `expand` (the spec with the nodes as
hosts), `record` / `recorded` (what was submitted, kept in the job's local directory, so that
`stop` cancels it whatever happens to the launch), `cancel_all`, `queue_states` (what each
scheduler says, for `status`). Each allocation is its scheduler's `Allocator`'s
(`nebula_cli.scheduler.registry`).
"""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Any

from nebula_cli.config.spec import ClusterSpec, JobSpec
from nebula_cli.errors import NebulaError
from nebula_cli.scheduler.allocation import Allocation
from nebula_cli.scheduler.allocation_state import AllocationState
from nebula_cli.scheduler.base import GetTransport, Progress
from nebula_cli.scheduler.registry import allocator_named
from nebula_cli.transport import Conn, Transport

RECORD = "allocations.json"
"""In the job's local directory: cluster -> its `Allocation` (`Allocation.to_data`)."""


def allocating_clusters(spec: JobSpec) -> list[ClusterSpec]:
    """The clusters whose hosts come from an allocation made at launch."""
    return [c for c in spec.clusters if c.scheduling.allocates]


def node_conns(allocs: dict[str, Allocation]) -> dict[str, Conn]:
    """"cluster/node" -> how to reach that node of its running allocation."""
    return {f"{a.cluster}/{n}": allocator_named(a.scheduler).node_conn(a, n)
            for a in allocs.values() for n in a.nodes}


def expand(spec: JobSpec, allocs: dict[str, Allocation]) -> JobSpec:
    """The spec with each allocated cluster's hosts replaced by its allocation's nodes (ranks
    per node as its scheduler says). For planning only: the job keeps its spec as written."""
    clusters = []
    for c in spec.clusters:
        alloc = allocs.get(c.name)
        if alloc is None or not c.scheduling.allocates:
            clusters.append(c)
            continue
        clusters.append(c.with_nodes(c.scheduling.allocated_hosts(c, alloc.nodes)))
    return spec.model_copy(update={"clusters": clusters})


def record(job_dir: Path, allocs: dict[str, Allocation]) -> None:
    """Keep what was submitted (so that `stop` cancels it, whatever happens to this launch)."""
    data = {name: a.to_data() for name, a in allocs.items()}
    (job_dir / RECORD).write_text(json.dumps(data, indent=1))


def recorded(job_dir: Path) -> dict[str, Allocation]:
    """What `record` kept (records of earlier versions too); {} when there is none."""
    try:
        data = json.loads((job_dir / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return {name: Allocation.from_data(a) for name, a in data.items()}


def cancel_all(job_dir: Path, transport: GetTransport, progress: Progress) -> list[str]:
    """Cancel every allocation the job asked for, each waited for until its scheduler says it
    has ended (bounded); what was cancelled, as its scheduler then says ("cluster: Slurm job
    12 CANCELLED, ended 1 s after scancel")."""
    done = []
    for name, alloc in recorded(job_dir).items():
        allocator = allocator_named(alloc.scheduler)
        said = allocator.cancel(transport(alloc.login), alloc)
        done.append(f"{name}: {said}")
        progress(f"{name}: {said}")
    return done


def queue_states(job_dir: Path, transport: GetTransport,
                 clusters: set[str]) -> dict[str, AllocationState]:
    """Of `clusters`, those on a running (or ended) allocation: cluster -> what its scheduler
    says of it ("Slurm job J STATE on NODES": what `status` shows)."""
    out = {}
    for name, alloc in recorded(job_dir).items():
        if name in clusters and alloc.nodes:
            out[name] = allocator_named(alloc.scheduler).state(transport(alloc.login), alloc)
    return out


def ended_state(said: AllocationState | None) -> bool:
    """Whether a `queue_states` answer says the allocation is over (False for None: a cluster
    with no allocation)."""
    return said is not None and said.ended


def last_status(t: Transport, agent_dir: str) -> dict[str, Any]:
    """What an agent last wrote (its status.json on the shared file system), or {}."""
    try:
        data = t.read_file(posixpath.join(agent_dir, "status.json"))
        found = json.loads(data) if data else {}
    except (NebulaError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
