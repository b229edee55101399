"""`Allocator`: how a scheduler's hosts are obtained at launch and ended, through the
transport of the host it is asked through (a Slurm cluster's login node).

The spec-side facts of the same scheduler (validation, node counts, checkpoint places) are
`config.schedulers`; a scheduler that allocates nothing (`none`) has no allocator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from nebula_cli.config.spec import ClusterSpec, JobSpec
from nebula_cli.scheduler.allocation import Allocation
from nebula_cli.scheduler.allocation_state import AllocationState
from nebula_cli.transport import Conn, Transport

Progress = Callable[[str], None]
GetTransport = Callable[[Conn], Transport]


class Allocator(Protocol):
    """One scheduler's allocations (stateless; one instance per name)."""

    name: str
    """The scheduler's name, as a cluster's `scheduler:` says it."""

    def check_host(self, t: Transport) -> None:
        """LaunchError naming the host when the host allocations are asked through lacks
        what this needs (Slurm: its commands on the login node's PATH)."""
        ...

    def preview(self, t: Transport, spec: JobSpec, cluster: ClusterSpec) -> str:
        """What the scheduler says it would give the cluster's request now (where, when),
        nothing asked for; SpecError at the spec's field when it refuses what it says
        (`validate --hosts`)."""
        ...

    def submit(self, t: Transport, login: Conn, spec: JobSpec, cluster: ClusterSpec,
               job_id: str, upload_lib: Callable[[str], None],
               progress: Progress) -> Allocation:
        """Ask for the cluster's allocation through `t` (nebula_cli uploaded with
        `upload_lib(job_root)` first); SpecError at the spec's field when the scheduler
        refuses what it says, LaunchError otherwise."""
        ...

    def wait_running(self, t: Transport, alloc: Allocation, node_transport: GetTransport,
                     progress: Progress, on_wait: Callable[[str], None]) -> Allocation:
        """Until the allocation runs and its nodes answer (`on_wait` gets why it waits);
        the allocation with its nodes."""
        ...

    def node_conn(self, alloc: Allocation, node: str) -> Conn:
        """How to reach one node of the running allocation."""
        ...

    def label(self, alloc: Allocation) -> str:
        """The allocation in messages ("Slurm job 12")."""
        ...

    def state(self, t: Transport, alloc: Allocation) -> AllocationState:
        """What the scheduler says of it now."""
        ...

    def cancel(self, t: Transport, alloc: Allocation) -> AllocationState:
        """End it (one that has ended already is fine) and wait, bounded, until the scheduler
        says it has ended; what the scheduler says then."""
        ...
