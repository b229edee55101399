"""nebula's batch script (slurm.sbatch, rendered by `batch`) in the shapes
sites give their jobs, on the test bed's real Slurm (nodes declaring 8 CPUs and 4 fake GPUs):
the keeper step holds each node's whole allocation, one keeper per node, whatever the batch
step's SLURM_* variables say; short steps from a login shell inside another allocation keep
their shape too. No DeepSpeed: tests/test_slurm_launch.py trains in one of these shapes.

REALWORLD Slurm rows: several ranks per node (`ntasks_per_node` 2 and 4), `cpus_per_task`,
`--exclusive`, a job that asks for every CPU of its nodes, GPUs per node and per task; memory
scheduled (`CR_Core_Memory`), as at most sites.

And how the job ends: cancelled (`nebula stop`), after Slurm's notice, with Slurm's daemons
gone, run again on a Slurm whose job ids started again: its keepers and what they started
never outlive the allocation.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.jobs import wait_for
from helpers.keeper_agent import DAEMON
from testbed import TestBed
from testbed.slurm import NODE_CPUS, NODE_GPUS, SBIN_PATH, cgroup_available
from testbed.system import kill_pids, namespace_pids

from nebula_cli.agent.procs import pid_alive
from nebula_cli.config.spec import parse_spec
from nebula_cli.errors import SpecError
from nebula_cli.scheduler.allocation import Allocation
from nebula_cli.schedulers.slurm.allocator import SlurmAllocator, output_path
from nebula_cli.transport import LocalTransport, Transport
from nebula_cli.transport.local.conn import LocalConn

pytestmark = pytest.mark.testbed

REPO = Path(__file__).resolve().parents[3]
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
        if not (lib / "nebula_cli").exists():  # (a job submitted again: there already)
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


def output(alloc: Allocation) -> str:
    """What the batch job wrote so far (its keepers' lines)."""
    try:
        return Path(output_path(alloc)).read_text()
    except OSError:
        return ""


def start_agent(allocator: SlurmAllocator, alloc: Allocation, node: str, t: Transport,
                mark: Path) -> dict[str, int]:
    """A stand-in agent started through the node's keeper (as `nebula launch` starts one):
    its pid and its keeper's."""
    nt = allocator.node_conn(alloc, node).open(through=t)
    started = nt.run_detached([sys.executable, "-c", DAEMON, "600", str(mark)], timeout=60)
    assert started.ok, (started, output(alloc))
    return json.loads(started.stdout.strip().splitlines()[-1])


def gone(*pids: int) -> bool:
    return not any(pid_alive(p) for p in pids)


def test_cancel_returns_once_slurm_ended_the_job_and_the_keepers_left_on_their_own(
        login: LocalTransport, slurm_bed: TestBed, tmp_path: Path) -> None:
    """`nebula stop`'s cancel: scancel reaches the batch script's trap, and the keepers (and
    what they run) end on their SIGTERM, so that the job is not COMPLETING until KillWait's
    SIGKILL (35-40 s at a site); `cancel` returns once Slurm says it ended, and says so."""
    assert slurm_bed.slurm is not None
    allocator, alloc = allocate(login, tmp_path, {"nodes": 2, "ntasks_per_node": 1})
    try:
        running = allocator.wait_running(login, alloc, lambda c: c.open(through=login),
                                         lambda _: None, lambda _: None)
        marks = [tmp_path / f"term-{node}" for node in running.nodes]
        agents = [start_agent(allocator, running, node, login, mark)
                  for node, mark in zip(running.nodes, marks, strict=True)]
        said = allocator.cancel(login, running)
        assert said.ended and f"Slurm job {alloc.job} CANCELLED, ended " in said.said, said
        assert slurm_bed.slurm.job_state(alloc.job) == "CANCELLED"
        out = output(alloc)
        # each keeper stopped its agent, then left by itself: none was killed at KillWait
        assert out.count("the job is being ended") == 2 and out.count(": done") == 2, out
        assert all(m.read_text() == "term" for m in marks)
        assert gone(*(pid for agent in agents for pid in agent.values()))
    finally:
        slurm_bed.slurm.cancel(alloc.job)


def test_after_slurms_notice_the_job_runs_until_slurm_ends_it_then_the_keepers_leave(
        login: LocalTransport, slurm_bed: TestBed, tmp_path: Path) -> None:
    """The notice (what `--signal=TERM@120` sends: the steps, not the batch shell) stops the
    agents; the keepers wait, so that Slurm ends the job and records why (TIMEOUT,
    PREEMPTED), and leave as soon as it does."""
    slurm = slurm_bed.slurm
    assert slurm is not None
    allocator, alloc = allocate(login, tmp_path, {"nodes": 1, "ntasks_per_node": 1})
    try:
        running = allocator.wait_running(login, alloc, lambda c: c.open(through=login),
                                         lambda _: None, lambda _: None)
        mark = tmp_path / "term"
        agent = start_agent(allocator, running, next(iter(running.nodes)), login, mark)
        notice = login.run(["scancel", "--signal=TERM", alloc.job], timeout=60)
        assert notice.ok, notice
        wait_for(lambda: "waiting for it to end the job" in output(alloc), timeout=60)
        assert mark.read_text() == "term" and gone(agent["agent_pid"])
        assert slurm.job_state(alloc.job) == "RUNNING"  # the keeper waits for Slurm
        assert pid_alive(agent["keeper_pid"])
        said = allocator.cancel(login, running)
        assert said.ended and slurm.job_state(alloc.job) == "CANCELLED", said
        assert "the job is being ended" in output(alloc) and gone(agent["keeper_pid"])
    finally:
        slurm.cancel(alloc.job)


ENDS = ("cancelled", "the notice, then Slurm's daemons gone", "Slurm's daemons gone")


def test_the_same_job_again_on_a_slurm_whose_job_ids_started_again_meets_no_earlier_keeper(
        make_testbed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four runs of a Slurm cluster on one node: one FAILED early, one left its allocation
    queued, and two keepers lived on long after their allocations, Slurm's daemons stopped:
    after the notice a keeper slept forever, and one whose step's slurmstepd died served on
    with its agents. The next job of the same id on that node (job ids start again with a
    fresh Slurm) found their socket file taken. Here the same job runs once per way of ending,
    each on a fresh Slurm (the same job id every time): nothing of a run outlives it, and each
    run's agent is started by that run's keeper."""
    tag = secrets.token_hex(2)
    login_host, node = f"rjl{tag}", f"rjn{tag}"  # node names of its own (keepers' sockets)
    bed = make_testbed({"rj": [login_host, node]}, rate_mbit=None, bastion=False,
                       slurm={"rj": login_host})
    slurm = bed.slurm
    assert slurm is not None
    t = login_of(bed, tmp_path, monkeypatch)
    ids: list[str] = []
    try:
        for run, end in enumerate(ENDS):
            if run:
                slurm.restart_fresh()
            allocator, alloc = allocate(t, tmp_path, {"nodes": 1, "ntasks_per_node": 1})
            ids.append(alloc.job)
            assert set(ids) == {alloc.job}, (end, ids)  # the same job id every run
            running = allocator.wait_running(t, alloc, lambda c: c.open(through=t),
                                             lambda _: None, lambda _: None)
            mark = tmp_path / f"term{run}"
            agent = start_agent(allocator, running, node, t, mark)
            ready = re.findall(r"ready \(pid (\d+)\)", output(alloc))
            assert ready == [str(agent["keeper_pid"])], (end, output(alloc))  # this run's
            if end == "cancelled":
                assert allocator.cancel(t, running).ended
            else:
                if "notice" in end:
                    assert t.run(["scancel", "--signal=TERM", alloc.job], timeout=60).ok
                    wait_for(lambda a=alloc: "waiting for it to end" in output(a), timeout=60)
                slurm.kill_daemons()
            try:  # (bounded: the keeper's events, not a time, are what is awaited)
                wait_for(lambda a=agent: gone(*a.values()), timeout=60)
            except AssertionError:
                pytest.fail(f"run {run} ({end}): keeper or agent alive 60 s after its "
                            f"allocation ended: {agent}\n{output(alloc)}")
            assert mark.read_text() == "term", end
            # what Slurm's killed daemons left of the batch step (its shell, its srun) is
            # theirs, not nebula's: ended here so that it cannot talk to the next Slurm
            kill_pids([p for p in namespace_pids(slurm.nodes[node].ns)
                       if p not in slurm.service_pids()])
    finally:
        t.close()
