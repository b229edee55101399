"""`Allocation`: the job's record of what a scheduler holds; records written before they named
their scheduler (or held typed connections) read back as Slurm's, unchanged."""

from __future__ import annotations

import json
from pathlib import Path

from nebula_cli.control import allocations
from nebula_cli.scheduler.allocation import Allocation
from nebula_cli.schedulers.slurm.node_conn import SlurmNodeConn
from nebula_cli.transport.ssh.conn import SshConn

LOGIN = {"transport": "ssh", "name": "login", "host": "login", "user": "jdoe", "port": None,
         "key": None, "jump": None, "python": "python3"}
EARLIER = {"hpc": {"cluster": "hpc", "login": LOGIN, "job": "12",
                   "job_root": "/home/jdoe/.nebula/jobs/j", "nodes": {"n1": "10.1.0.1",
                                                                      "n2": "10.1.0.2"}}}
"""allocations.json as nebula wrote it before (dataclasses.asdict of its Allocation)."""


def test_an_earlier_record_reads_back_as_slurms(tmp_path: Path) -> None:
    (tmp_path / allocations.RECORD).write_text(json.dumps(EARLIER, indent=1))
    (alloc,) = allocations.recorded(tmp_path).values()
    assert alloc.scheduler == "slurm" and alloc.job == "12"
    assert alloc.login == SshConn(name="login", host="login", user="jdoe", python="python3")
    assert list(alloc.nodes) == ["n1", "n2"]  # Slurm's order: the first is the master
    assert alloc.to_data() == {**EARLIER["hpc"], "scheduler": "slurm"}


def test_what_is_recorded_is_read_back(tmp_path: Path) -> None:
    alloc = Allocation(cluster="hpc", login=SshConn(name="login", python="python3"), job="7",
                       job_root="/r", nodes={"n1": "a1"}, scheduler="slurm")
    allocations.record(tmp_path, {"hpc": alloc})
    assert allocations.recorded(tmp_path) == {"hpc": alloc}
    assert allocations.recorded(tmp_path / "elsewhere") == {}  # nothing submitted


def test_each_node_is_reached_through_the_login_node() -> None:
    alloc = Allocation.from_data(EARLIER["hpc"])
    conns = allocations.node_conns({"hpc": alloc})
    assert list(conns) == ["hpc/n1", "hpc/n2"]
    node = conns["hpc/n2"]
    assert isinstance(node, SlurmNodeConn) and node.through == alloc.login
    assert (node.node, node.address, node.job, node.keeper) == ("n2", "10.1.0.2", "12", "12")
    assert node.pythonpath == "/home/jdoe/.nebula/jobs/j/lib"  # the uploaded nebula_cli
