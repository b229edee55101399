"""nebula's batch script (slurm.sbatch, rendered by `batch`) in the shapes
sites give their jobs, on the test bed's real Slurm (nodes declaring 8 CPUs and 4 fake GPUs):
the keeper step holds each node's whole allocation, one keeper per node, whatever the batch
step's SLURM_* variables say; short steps from a login shell inside another allocation keep
their shape too. No DeepSpeed: tests/test_slurm_launch.py trains in one of these shapes.

REALWORLD Slurm rows: several ranks per node (`ntasks_per_node` 2 and 4), `cpus_per_task`,
`--exclusive`, a job that asks for every CPU of its nodes, GPUs per node and per task; memory
scheduled (`CR_Core_Memory`), as at most sites.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from testbed import TestBed
from testbed.slurm import NODE_CPUS, NODE_GPUS, SBIN_PATH, cgroup_available

from nebula_cli.config.spec import parse_spec
from nebula_cli.errors import SpecError
from nebula_cli.schedulers.slurm.allocator import SlurmAllocator
from nebula_cli.transport import LocalTransport
from nebula_cli.transport.local_conn import LocalConn

pytestmark = pytest.mark.testbed

REPO = Path(__file__).resolve().parents[2]
ENV_PY = ("import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
          "if k.startswith('SLURM')}))")


def login_of(bed: TestBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalTransport:
    """This machine as the login node, its shell inside an interactive job of another shape
    (the SLURM_* variables `salloc -N1 -n3 -c3` leaves), talking to the bed's Slurm."""
    assert bed.slurm is not None
    monkeypatch.setenv("SLURM_CONF", str(bed.slurm.conf))
    monkeypatch.setenv("PATH", f"{os.environ['PATH']}:{SBIN_PATH}")
    for name, value in {"SLURM_JOB_ID": "999", "SLURM_NTASKS": "3", "SLURM_NPROCS": "3",
                        "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "3",
                        "SLURM_CPUS_PER_TASK": "3", "SRUN_CPUS_PER_TASK": "3"}.items():
        monkeypatch.setenv(name, value)
    return LocalTransport("login", home=str(tmp_path / "home"))


@pytest.fixture
def login(slurm_bed: TestBed, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalTransport]:
    """`login_of` the session bed's Slurm."""
    t = login_of(slurm_bed, tmp_path, monkeypatch)
    yield t
    t.close()


def allocate(t: LocalTransport, tmp_path: Path, slurm: dict[str, Any]) -> Any:
    spec = parse_spec(yaml.safe_dump({
        "name": "shapes", "run": "true", "clusters": [{
            "name": "hpc", "scheduler": "slurm", "python": sys.executable,
            "hosts": [{"host": "login"}], "slurm": {"time": "00:05:00", **slurm}}]}))
    cluster = spec.clusters[0]

    def upload_lib(job_root: str) -> None:
        lib = Path(job_root) / "lib"
        lib.mkdir(parents=True, exist_ok=True)
        (lib / "nebula_cli").symlink_to(REPO / "nebula_cli")

    allocator = SlurmAllocator()
    conn = LocalConn(name="login", home=t.home, python=sys.executable)
    alloc = allocator.submit(t, conn, spec, cluster, "shapes1", upload_lib, lambda _: None)
    return allocator, alloc


SHAPES = {  # slurm: section -> (nodes, CPUs and GPUs the keeper's step holds on each node)
    "2 ranks per node": ({"nodes": 2, "ntasks_per_node": 2}, 2, 2, 0),
    "4 ranks per node, one GPU each": (
        {"nodes": 2, "ntasks_per_node": 4, "gpus_per_node": NODE_GPUS}, 2, 4, NODE_GPUS),
    "every CPU of the node, a GPU per task": (
        {"nodes": 1, "ntasks_per_node": 2, "cpus_per_task": NODE_CPUS // 2,
         "sbatch_args": ["--gpus-per-task=1"]}, 1, NODE_CPUS, 2),
    "exclusive (the whole node: every GPU too)": (
        {"nodes": 2, "ntasks_per_node": 1, "sbatch_args": ["--exclusive"]},
        2, NODE_CPUS, NODE_GPUS),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_keeper_step_holds_each_nodes_allocation(login: LocalTransport, slurm_bed: TestBed,
                                                     tmp_path: Path, shape: str) -> None:
    slurm, nodes, cpus, gpus = SHAPES[shape]
    allocator, alloc = allocate(login, tmp_path, slurm)
    try:
        running = allocator.wait_running(login, alloc, lambda c: c.open(through=login),
                                         lambda _: None, lambda _: None)
        assert len(running.nodes) == nodes
        for node in running.nodes:
            t = allocator.node_conn(running, node).open(through=login)
            seen = t.run_detached([sys.executable, "-c", ENV_PY], timeout=60)
            assert seen.ok, (seen, (Path(alloc.job_root) / "slurm").glob("*.out"))
            env = json.loads(seen.stdout.strip().splitlines()[-1])
            # one keeper per node (a step of `nodes` tasks), holding all the node gives the job
            assert env["SLURM_JOB_ID"] == alloc.job and env["SLURMD_NODENAME"] == node
            assert env["SLURM_STEP_NUM_TASKS"] == str(nodes)
            assert env["SLURM_STEP_TASKS_PER_NODE"] == ("1" if nodes == 1 else f"1(x{nodes})")
            assert env["SLURM_CPUS_ON_NODE"] == str(cpus), env
            assert env.get("SLURM_GPUS_ON_NODE", "0") == str(gpus), env
            assert env["SLURM_NTASKS"] == str(nodes) and "SLURM_CPUS_PER_TASK" not in env
            # a short step from the login shell: one task, whatever that shell's job said
            step = t.run(["/bin/sh", "-c", "echo $SLURM_STEP_NUM_TASKS $SLURM_JOB_ID"],
                         timeout=60)
            assert step.ok and step.stdout.split() == ["1", alloc.job], step
    finally:
        allocator.cancel(login, alloc)
        assert slurm_bed.slurm is not None
        slurm_bed.slurm.cancel(alloc.job)


def test_preview_says_where_slurm_would_start_the_job_and_submits_nothing(
        login: LocalTransport, slurm_bed: TestBed, tmp_path: Path) -> None:
    spec = parse_spec(yaml.safe_dump({
        "name": "shapes", "run": "true", "clusters": [{
            "name": "hpc", "scheduler": "slurm", "python": sys.executable,
            "hosts": [{"host": "login"}],
            "slurm": {"nodes": 2, "ntasks_per_node": 4, "gpus_per_node": 2}}]}))
    said = SlurmAllocator().preview(login, spec, spec.clusters[0])
    assert said.startswith("Slurm on login: Job ") and "on nodes c[1-2]" in said, said
    assert "using 8 processors" in said and "in partition debug" in said, said
    refused = spec.model_copy(update={"clusters": [spec.clusters[0].model_copy(update={
        "slurm": spec.clusters[0].slurm.model_copy(update={"partition": "nope"})})]})
    with pytest.raises(SpecError) as info:
        SlurmAllocator().preview(login, refused, refused.clusters[0])
    assert info.value.field == "clusters[0].slurm.partition", str(info.value)
    assert "Slurm on login refuses the job" in str(info.value)
    assert slurm_bed.slurm is not None and slurm_bed.slurm.active_jobs() == []
    assert not Path(login.home).exists()  # nothing written on the login node


DEVICES_PY = """
import errno, json, os, sys
seen = {}
for path in sys.argv[1:]:
    try:
        os.close(os.open(path, os.O_RDONLY))
        seen[path] = "opened"
    except OSError as exc:
        seen[path] = errno.errorcode[exc.errno]
cgroup = [line.split(":", 2)[2] for line in open("/proc/self/cgroup").read().splitlines()
          if line.split(":")[1] == "freezer"][0]
print(json.dumps({"devices": seen, "cgroup": cgroup,
                  "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}))
"""


def test_under_cgroups_the_keepers_children_live_in_its_step_with_its_gpus(
        make_testbed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """REALWORLD Slurm: `ProctrackType=proctrack/cgroup`, `TaskPlugin=task/cgroup,task/affinity`
    with ConstrainDevices (most sites). What the keeper starts (the agent, its ranks) is in the
    keeper's step (its cgroup outlives the short step that asked) and may open the step's GPUs
    only; a short step is a step of its own. Node names are unique per test: slurmd names its
    cgroups by node (`/sys/fs/cgroup/<controller>/slurm_<node>`), shared by every bed here."""
    ok, why = cgroup_available()
    if not ok:
        pytest.skip(why)
    tag = secrets.token_hex(2)
    login_host, node = f"cgl{tag}", f"cgn{tag}"
    bed = make_testbed({"cg": [login_host, node]}, rate_mbit=None, bastion=False,
                       slurm={"cg": login_host}, slurm_cgroup=True)
    t = login_of(bed, tmp_path, monkeypatch)
    allocator, alloc = allocate(t, tmp_path, {"nodes": 1, "ntasks_per_node": 2,
                                              "gpus_per_node": 2})
    gpus = [str(bed.dir / "slurm" / "dev" / f"{node}-gpu{i}") for i in range(NODE_GPUS)]
    try:
        running = allocator.wait_running(t, alloc, lambda c: c.open(through=t),
                                         lambda _: None, lambda _: None)
        nt = allocator.node_conn(running, node).open(through=t)
        kept = nt.run_detached([sys.executable, "-c", DEVICES_PY, *gpus], timeout=60)
        short = nt.run([sys.executable, "-c", DEVICES_PY, *gpus], timeout=60)
        assert kept.ok and short.ok, (kept, short)
        kept_seen = json.loads(kept.stdout.strip().splitlines()[-1])
        short_seen = json.loads(short.stdout.strip().splitlines()[-1])
        job = f"/slurm_{node}/uid_{os.getuid()}/job_{alloc.job}"
        assert kept_seen["cgroup"] == f"{job}/step_0", kept_seen  # the keeper's step
        assert short_seen["cgroup"].startswith(f"{job}/step_") and \
            short_seen["cgroup"] != kept_seen["cgroup"], short_seen
        # no driver answers (ENXIO) on the step's two GPUs; the cgroup denies the others
        assert list(kept_seen["devices"].values()) == ["ENXIO", "ENXIO", "EPERM", "EPERM"]
        assert kept_seen["cuda"] == "0,1"
    finally:
        allocator.cancel(t, alloc)
        assert bed.slurm is not None
        bed.slurm.cancel(alloc.job)
        t.close()
