"""`SlurmAllocator`: one batch job per Slurm cluster holds its nodes for the whole run.

`preview` (``sbatch --test-only``: what Slurm would give the spec, for `validate --hosts`),
`submit` (on the login node: nebula_cli uploaded, `slurm.sbatch` rendered, `sbatch`),
`wait_running` (the job QUEUED with Slurm's reason until it starts, then every node's keeper
answering), `node_conn` (a node, reached through the login node), `state` and `cancel` (until
Slurm says the job has ended, bounded).
"""

from __future__ import annotations

import dataclasses
import posixpath
import time
from collections.abc import Callable
from pathlib import Path

from nebula_cli.config import plan_model
from nebula_cli.config.spec import ClusterSpec, JobSpec
from nebula_cli.errors import LaunchError, NebulaError, UsageError
from nebula_cli.launchers import launcher
from nebula_cli.scheduler.allocation import Allocation
from nebula_cli.scheduler.allocation_state import AllocationState
from nebula_cli.scheduler.base import GetTransport, Progress
from nebula_cli.schedulers.slurm import batch, slurm_cli
from nebula_cli.schedulers.slurm.node_conn import SlurmNodeConn
from nebula_cli.schedulers.slurm.scheduler import slurm_request
from nebula_cli.transport import Conn, Transport

POLL = 2.0
"""Seconds between looks at the queue."""
KEEPER_TIMEOUT = 180.0
"""Seconds the nodes' keepers have to answer once the allocation runs."""
OUTPUT_LINES = 15
CANCEL_WAIT = 90.0
"""Seconds `cancel` waits for Slurm to end the job after scancel (it stays COMPLETING until
every process of it has ended, at worst KillWait, 30 s by default, after their SIGTERM)."""
CANCEL_POLL = 0.5


def template_of(spec: JobSpec, cluster: ClusterSpec) -> str:
    """The batch template: the spec's own (relative to the spec) or the packaged
    schedulers/slurm/slurm.sbatch."""
    request = slurm_request(cluster)
    if request.template is None:
        return launcher("slurm.sbatch", __package__).decode()
    path = Path(request.template).expanduser()
    if not path.is_absolute() and spec.source:
        path = Path(spec.source).parent / path
    try:
        return path.read_text()
    except OSError as exc:
        raise UsageError(f"clusters[{cluster.name}].slurm.template: cannot read {path}: "
                         f"{exc.strerror}") from exc


def keeper_name(alloc: Allocation) -> str:
    """The name its nodes' keepers serve under (schedulers/slurm/slurm.sbatch: the Slurm job id)."""
    return alloc.job


def output_path(alloc: Allocation) -> str:
    """Where Slurm writes the batch script's output."""
    return posixpath.join(alloc.job_root, "slurm", f"{alloc.cluster}-{alloc.job}.out")


class SlurmAllocator:
    """Slurm through its tools on the cluster's login node (`slurm_cli`)."""

    name = "slurm"

    def check_host(self, t: Transport) -> None:
        slurm_cli.require_commands(t)

    def preview(self, t: Transport, spec: JobSpec, cluster: ClusterSpec) -> str:
        """Slurm's answer to the cluster's batch script now (``sbatch --test-only``: where and
        when it would start; nothing written, nothing submitted); SpecError at the `slurm:`
        field Slurm refuses."""
        slurm_cli.require_commands(t)
        job_root = posixpath.join(t.home, "jobs", "JOB")
        seen = slurm_cli.test_only(t, _script(spec, cluster, "JOB", job_root))
        if not seen.ok:
            raise _refused(spec, cluster, t, seen)
        return f"Slurm on {t.name}: {seen.said}"

    def submit(self, t: Transport, login: Conn, spec: JobSpec, cluster: ClusterSpec,
               job_id: str, upload_lib: Callable[[str], None],
               progress: Progress) -> Allocation:
        """On the login node: the job's directory, nebula_cli (`upload_lib(job_root)`), the
        batch script; then sbatch. SpecError at the `slurm:` field Slurm's refusal is about
        (`sbatch --test-only` first), LaunchError with Slurm's words otherwise."""
        slurm_cli.require_commands(t)
        job_root = posixpath.join(t.home, "jobs", job_id)
        t.makedirs(posixpath.join(job_root, "slurm"), mode=0o700)
        upload_lib(job_root)
        script = _script(spec, cluster, job_id, job_root)
        path = posixpath.join(job_root, "slurm", f"{cluster.name}.sbatch")
        t.put_bytes(script.encode(), path, mode=0o700)
        seen = slurm_cli.test_only(t, script, job_root)
        if not seen.ok:
            raise _refused(spec, cluster, t, seen)
        job = slurm_cli.submit(t, path, job_root)
        progress(f"{cluster.name}: submitted Slurm job {job} on {t.name} ({path})")
        return Allocation(cluster=cluster.name, login=login, job=job, job_root=job_root,
                          scheduler=self.name)

    def wait_running(self, t: Transport, alloc: Allocation, node_transport: GetTransport,
                     progress: Progress, on_wait: Callable[[str], None]) -> Allocation:
        """Until the allocation runs (each change of state shown: `on_wait` gets it while the
        job waits), then until every node's keeper answers."""
        said = ""
        while True:  # a cancelled launch aborts the transport: queue_state raises
            state = slurm_cli.queue_state(t, alloc.job)
            if str(state) != said:
                said = str(state)
                progress(f"{alloc.cluster}: Slurm job {alloc.job} {said}")
                if state.waiting:
                    on_wait(f"{alloc.cluster}: Slurm job {alloc.job} {said}")
            if state.state == slurm_cli.RUNNING and state.nodelist:
                break
            if state.ended:
                raise LaunchError(f"{alloc.cluster}: Slurm job {alloc.job} ended before nebula "
                                  f"started on it ({said}){_output(t, alloc)}")
            time.sleep(POLL)
        names = slurm_cli.hostnames(t, state.nodelist)
        alloc = dataclasses.replace(alloc, nodes=slurm_cli.node_addresses(t, names))
        deadline = time.monotonic() + KEEPER_TIMEOUT
        waiting = list(names)
        while waiting:
            node = waiting[0]
            result = node_transport(self.node_conn(alloc, node)).run_detached(["true"],
                                                                              timeout=30)
            if result.ok:
                waiting.pop(0)
                continue
            if time.monotonic() > deadline or result.exit_code != 3:
                raise LaunchError(f"{alloc.cluster}/{node}: nebula's keeper does not answer in "
                                  f"Slurm job {alloc.job}: {result}{_output(t, alloc)}")
            time.sleep(POLL)
        progress(f"{alloc.cluster}: Slurm job {alloc.job} runs on {', '.join(names)}")
        return alloc

    def node_conn(self, alloc: Allocation, node: str) -> Conn:
        """The node, its commands run as ``srun --overlap`` steps from the login node."""
        return SlurmNodeConn(name=node, login=alloc.login, job=alloc.job, node=node,
                             address=alloc.nodes[node], keeper=keeper_name(alloc),
                             python=alloc.login.python,
                             pythonpath=plan_model.lib_dir(alloc.job_root))

    def label(self, alloc: Allocation) -> str:
        return f"Slurm job {alloc.job}"

    def state(self, t: Transport, alloc: Allocation) -> AllocationState:
        """"Slurm job J STATE on NODES" (STATE one of Slurm's: squeue's, else sacct's)."""
        state = slurm_cli.queue_state(t, alloc.job)
        return allocation_state(alloc.job, state)

    def cancel(self, t: Transport, alloc: Allocation) -> AllocationState:
        """scancel, then until Slurm says the job has ended (at most `CANCEL_WAIT` seconds);
        what it says then, with how long it took ("Slurm job 12 CANCELLED, ended 1 s after
        scancel")."""
        slurm_cli.cancel(t, alloc.job)
        start = time.monotonic()
        while not (state := slurm_cli.queue_state(t, alloc.job)).ended:
            if time.monotonic() - start > CANCEL_WAIT:
                return AllocationState(f"Slurm job {alloc.job} still {state} {CANCEL_WAIT:g} s "
                                       "after scancel (nebula waited no longer: Slurm ends it)",
                                       ended=False)
            time.sleep(CANCEL_POLL)
        return AllocationState(f"Slurm job {alloc.job} {state}, ended "
                               f"{time.monotonic() - start:.0f} s after scancel", ended=True)


def _script(spec: JobSpec, cluster: ClusterSpec, job_id: str, job_root: str) -> str:
    """The cluster's batch script for job `job_id`, its files under `job_root`."""
    out = posixpath.join(job_root, "slurm", f"{cluster.name}-%j.out")
    return batch.render(template_of(spec, cluster), batch.values(
        slurm_request(cluster), job_name=f"nebula-{job_id}-{cluster.name}", output=out,
        job_root=job_root, pythonpath=plan_model.lib_dir(job_root), python=cluster.python))


def _refused(spec: JobSpec, cluster: ClusterSpec, t: Transport,
             seen: slurm_cli.TestOnly) -> NebulaError:
    """Slurm's refusal as a SpecError at the `slurm:` field it is about."""
    index = spec.clusters.index(cluster)
    return spec.problem_at(("clusters", index, "slurm", *((seen.field,) if seen.field else ())),
                           f"Slurm on {t.name} refuses the job: {seen.said}")


def allocation_state(job: str, state: slurm_cli.QueueState) -> AllocationState:
    """Slurm's state of job `job` as `status` shows it, ended or not."""
    where = f" on {state.nodelist}" if state.nodelist else ""
    return AllocationState(f"Slurm job {job} {state}{where}", ended=state.ended)


def _output(t: Transport, alloc: Allocation) -> str:
    path = output_path(alloc)
    try:
        data, _ = t.read_tail(path, 0)
    except NebulaError:
        return ""
    lines = data.decode(errors="replace").strip().splitlines()[-OUTPUT_LINES:]
    return f"\n  {path}:\n    " + "\n    ".join(lines) if lines else ""


ALLOCATOR = SlurmAllocator()
"""Slurm's allocations (`nebula_cli.schedulers.registry`)."""
