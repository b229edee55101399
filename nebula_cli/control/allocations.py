"""Slurm clusters at launch: one batch job per cluster holds its nodes; the job's plan is then
made as for SSH hosts, with the allocation's nodes as the cluster's hosts.

`submit` (on the login node: nebula_cli uploaded, `launchers/slurm.sbatch` rendered, `sbatch`),
`wait_running` (the job QUEUED with Slurm's reason until it starts, then every node's keeper
answering), `expand` (the spec with the nodes as hosts), `cancel_all` (scancel what a job
submitted, from the record kept in the job's local directory). See `nebula_cli.scheduler`.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nebula_cli.config import plan_model
from nebula_cli.config.hosts import HostSpec
from nebula_cli.config.spec import ClusterSpec, JobSpec
from nebula_cli.control.launchers import LAUNCHERS_DIR
from nebula_cli.errors import LaunchError, NebulaError, UsageError
from nebula_cli.scheduler import batch, slurm
from nebula_cli.transport import slurm_node
from nebula_cli.transport.base import Transport

RECORD = "allocations.json"
"""In the job's local directory: cluster -> {login conn, Slurm job id, nodes}."""
POLL = 2.0
"""Seconds between looks at the queue."""
KEEPER_TIMEOUT = 180.0
"""Seconds the nodes' keepers have to answer once the allocation runs."""
OUTPUT_LINES = 15

Progress = Callable[[str], None]
GetTransport = Callable[[dict[str, Any]], Transport]


@dataclasses.dataclass
class Allocation:
    """One Slurm cluster's batch job, as submitted and (once running) with its nodes."""

    cluster: str
    login: dict[str, Any]
    job: str
    job_root: str
    nodes: dict[str, str] = dataclasses.field(default_factory=dict)
    """node name -> address, in Slurm's order (the first is the cluster's master)."""

    @property
    def keeper(self) -> str:
        """The name its keepers serve under (launchers/slurm.sbatch: the Slurm job id)."""
        return self.job

    @property
    def output(self) -> str:
        return posixpath.join(self.job_root, "slurm", f"{self.cluster}-{self.job}.out")

    def conn(self, node: str) -> dict[str, Any]:
        return slurm_node(self.login, job=self.job, node=node, address=self.nodes[node],
                          keeper=self.keeper, pythonpath=plan_model.lib_dir(self.job_root))


def in_allocation(conn: dict[str, Any]) -> bool:
    """Whether an agent's machine is a node of a Slurm allocation (gone when it ends), not a
    login node (a relay there with `relay_on: login` outlives the allocation)."""
    return conn.get("transport") == "slurm-node"


def slurm_clusters(spec: JobSpec) -> list[ClusterSpec]:
    return [c for c in spec.clusters if c.scheduler == "slurm"]


def template_of(spec: JobSpec, cluster: ClusterSpec) -> str:
    """The batch template: the spec's own (relative to the spec) or launchers/slurm.sbatch."""
    request = cluster.slurm_request
    assert request is not None
    if request.template is None:
        path = LAUNCHERS_DIR / "slurm.sbatch"
    else:
        path = Path(request.template).expanduser()
        if not path.is_absolute() and spec.source:
            path = Path(spec.source).parent / path
    try:
        return path.read_text()
    except OSError as exc:
        raise UsageError(f"clusters[{cluster.name}].slurm.template: cannot read {path}: "
                         f"{exc.strerror}") from exc


def submit(t: Transport, login: dict[str, Any], spec: JobSpec, cluster: ClusterSpec,
           job_id: str, upload_lib: Callable[[str], None], progress: Progress) -> Allocation:
    """On the login node: the job's directory, nebula_cli (`upload_lib(job_root)`), the batch
    script; then sbatch. LaunchError with Slurm's words when it refuses."""
    request = cluster.slurm_request
    assert request is not None
    slurm.require_commands(t)
    job_root = posixpath.join(t.home, "jobs", job_id)
    t.makedirs(posixpath.join(job_root, "slurm"), mode=0o700)
    upload_lib(job_root)
    out = posixpath.join(job_root, "slurm", f"{cluster.name}-%j.out")
    script = batch.render(template_of(spec, cluster), batch.values(
        request, job_name=f"nebula-{job_id}-{cluster.name}", output=out, job_root=job_root,
        pythonpath=plan_model.lib_dir(job_root), python=cluster.python))
    path = posixpath.join(job_root, "slurm", f"{cluster.name}.sbatch")
    t.put_bytes(script.encode(), path, mode=0o700)
    refused = slurm.test_only(t, path, job_root)
    if refused is not None:
        field, said = refused
        index = spec.clusters.index(cluster)
        raise spec.problem_at(("clusters", index, "slurm", *((field,) if field else ())),
                              f"Slurm on {t.name} refuses the job: {said}")
    job = slurm.submit(t, path, job_root)
    progress(f"{cluster.name}: submitted Slurm job {job} on {t.name} ({path})")
    return Allocation(cluster=cluster.name, login=login, job=job, job_root=job_root)


def wait_running(t: Transport, alloc: Allocation, node_transport: GetTransport,
                 progress: Progress, on_wait: Callable[[str], None]) -> Allocation:
    """Until the allocation runs (each change of state shown: `on_wait` gets it while the job
    waits), then until every node's keeper answers. The allocation with its nodes."""
    said = ""
    while True:  # a cancelled launch aborts the transport: queue_state raises
        state = slurm.queue_state(t, alloc.job)
        if str(state) != said:
            said = str(state)
            progress(f"{alloc.cluster}: Slurm job {alloc.job} {said}")
            if state.waiting:
                on_wait(f"{alloc.cluster}: Slurm job {alloc.job} {said}")
        if state.state == slurm.RUNNING and state.nodelist:
            break
        if state.ended:
            raise LaunchError(f"{alloc.cluster}: Slurm job {alloc.job} ended before nebula "
                              f"started on it ({said}){_output(t, alloc)}")
        time.sleep(POLL)
    names = slurm.hostnames(t, state.nodelist)
    alloc = dataclasses.replace(alloc, nodes=slurm.node_addresses(t, names))
    deadline = time.monotonic() + KEEPER_TIMEOUT
    waiting = list(names)
    while waiting:
        node = waiting[0]
        result = node_transport(alloc.conn(node)).run_detached(["true"], timeout=30)
        if result.ok:
            waiting.pop(0)
            continue
        if time.monotonic() > deadline or result.exit_code != 3:
            raise LaunchError(f"{alloc.cluster}/{node}: nebula's keeper does not answer in "
                              f"Slurm job {alloc.job}: {result}{_output(t, alloc)}")
        time.sleep(POLL)
    progress(f"{alloc.cluster}: Slurm job {alloc.job} runs on {', '.join(names)}")
    return alloc


def _output(t: Transport, alloc: Allocation) -> str:
    try:
        data, _ = t.read_tail(alloc.output, 0)
    except NebulaError:
        return ""
    lines = data.decode(errors="replace").strip().splitlines()[-OUTPUT_LINES:]
    return f"\n  {alloc.output}:\n    " + "\n    ".join(lines) if lines else ""


def expand(spec: JobSpec, allocs: dict[str, Allocation]) -> JobSpec:
    """The spec with each Slurm cluster's hosts replaced by its allocation's nodes (ranks per
    node: `ntasks_per_node`). For planning only: the job keeps its spec as written."""
    clusters = []
    for c in spec.clusters:
        alloc, request = allocs.get(c.name), c.slurm_request
        if alloc is None or request is None:
            clusters.append(c)
            continue
        hosts = [HostSpec(host=n, address=a, slots=request.ntasks_per_node)
                 for n, a in alloc.nodes.items()]
        clusters.append(c.with_nodes(hosts))
    return spec.model_copy(update={"clusters": clusters})


def record(job_dir: Path, allocs: dict[str, Allocation]) -> None:
    """Keep what was submitted (so that `stop` cancels it, whatever happens to this launch)."""
    data = {name: dataclasses.asdict(a) for name, a in allocs.items()}
    (job_dir / RECORD).write_text(json.dumps(data, indent=1))


def recorded(job_dir: Path) -> dict[str, Allocation]:
    try:
        data = json.loads((job_dir / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return {name: Allocation(**a) for name, a in data.items()}


def cancel_all(job_dir: Path, transport: GetTransport, progress: Progress) -> list[str]:
    """scancel every Slurm job the job submitted; what was cancelled ("cluster: job id")."""
    done = []
    for name, alloc in recorded(job_dir).items():
        slurm.cancel(transport(alloc.login), alloc.job)
        done.append(f"{name}: Slurm job {alloc.job}")
        progress(f"{name}: Slurm job {alloc.job} cancelled")
    return done


def queue_states(job_dir: Path, transport: GetTransport,
                 clusters: set[str]) -> dict[str, str]:
    """Of `clusters`, those on a Slurm allocation: cluster -> "Slurm job J STATE on NODES"
    (what `status` shows; STATE is one of Slurm's, see `ended_state`)."""
    out = {}
    for name, alloc in recorded(job_dir).items():
        if name in clusters and alloc.nodes:
            state = slurm.queue_state(transport(alloc.login), alloc.job)
            where = f" on {state.nodelist}" if state.nodelist else ""
            out[name] = f"Slurm job {alloc.job} {state}{where}"
    return out


def ended_state(said: str | None) -> bool:
    """Whether a `queue_states` text says the allocation is over (False for anything else: a
    cluster with no Slurm allocation)."""
    words = (said or "").split()
    if len(words) < 4 or words[:2] != ["Slurm", "job"]:
        return False
    return slurm.QueueState(words[3]).ended


def last_status(t: Transport, agent_dir: str) -> dict[str, Any]:
    """What an agent last wrote (its status.json on the shared file system), or {}."""
    try:
        data = t.read_file(posixpath.join(agent_dir, "status.json"))
        found = json.loads(data) if data else {}
    except (NebulaError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
