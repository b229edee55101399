"""validate --hosts --params: a host's memory as the probe finds it (MemAvailable, a cgroup's
limit, in a real child memory cgroup when the tests run as root) and the refusal of a host that
cannot hold the outer step (control/memory_fit.py, control/hostcheck.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.jobs import CLI, write_spec

from nebula_cli.config.spec import load_spec
from nebula_cli.control.hostcheck import check_host
from nebula_cli.control.memory_fit import memory_problems
from nebula_cli.planner.outer_memory import FIXES, host_need, refusal
from nebula_cli.transport.local.transport import LocalTransport

LIMIT = 700 << 20


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


@pytest.fixture
def memory_cgroup(tmp_path: Path) -> Iterator[Path]:
    """A child memory cgroup of this process's own, limited to LIMIT (v2 or v1)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a cgroup")
    base = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            base, limit_file = Path("/sys/fs/cgroup" + path), "memory.max"
        elif "memory" in controllers.split(","):
            base, limit_file = Path("/sys/fs/cgroup/memory" + path), "memory.limit_in_bytes"
            break
    if base is None:
        pytest.skip("no memory cgroup")
    group = base / f"nebula-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(LIMIT))
    except OSError as exc:
        if group.exists():
            group.rmdir()
        pytest.skip(f"cannot make a memory cgroup: {exc}")
    try:
        yield group
    finally:
        group.rmdir()  # its one process (the probe) has ended


def test_the_probe_reads_mem_available(tmp_path: Path) -> None:
    check = check_host(LocalTransport("h", home=str(tmp_path)), "east", "h", 1)
    assert check.ok and check.mem_available is not None
    assert abs(check.mem_available - mem_available()) < mem_available() // 4
    assert check.memory_bytes == min(n for n in (check.mem_available, check.cgroup_limit) if n)


def test_the_probe_reads_its_cgroups_limit(tmp_path: Path, memory_cgroup: Path) -> None:
    python = tmp_path / "python-limited"
    python.write_text(f'#!/bin/sh\necho $$ > "{memory_cgroup}/cgroup.procs"\n'
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    check = check_host(LocalTransport("h", home=str(tmp_path), python=str(python)),
                       "east", "h", 1)
    assert check.ok and check.cgroup_limit == LIMIT and check.memory_bytes == LIMIT


def test_validate_refuses_a_host_that_cannot_hold_the_outer_step(tmp_path: Path,
                                                                 cli: CLI) -> None:
    params = 2 * mem_available() // 4  # one copy is half the host: 7 copies cannot fit
    spec = write_spec(tmp_path, f"""
name: big
run: echo hi
clusters:
  - name: east
    transport: local
    python: {sys.executable}
    hosts: [{{host: gpu-7, slots: 2}}]
""")
    proc = cli("validate", str(spec), "--hosts", "--params", str(params), timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    need = host_need(params, 2, 2, 0, relay=True)
    assert "east/gpu-7" in proc.stderr and f"{need / (1 << 30):.2f} GiB" in proc.stderr
    assert all(fix in " ".join(proc.stderr.split()) for fix in FIXES)
    assert "outer-step memory per process" in proc.stdout and "Traceback" not in proc.stderr
    fits = cli("validate", str(spec), "--hosts", "--params", "1000", timeout=120)
    assert fits.returncode == 0, fits.stdout + fits.stderr


def test_a_slurm_allocations_first_node_is_fitted_to_its_mem(tmp_path: Path) -> None:
    """A Slurm cluster's nodes are not probed before launch: its `--mem` is what each node
    grants, and the first node (rank 0 and the relay) must hold its part of the outer step;
    with `relay_on: login` the relay is not on that node; without a fixed --mem nothing is said."""
    text = """
name: hpc
run: echo hi
clusters:
  - name: hpc
    hosts: [login.hpc.example.edu]
    scheduler: slurm{relay}
    slurm: {{nodes: 2, ntasks_per_node: 4, sbatch_args: [{mem}]}}
"""
    params = 100_000_000  # 400 MB a copy
    for relay, mem, fits in (("", '"--mem=1G"', False), ("", '"--mem=64G"', True),
                             ("\n    relay_on: login", '"--mem=1G"', False),
                             ("", '"--exclusive"', True)):
        spec = load_spec(write_spec(tmp_path, text.format(relay=relay, mem=mem)))
        problems = memory_problems(spec, [], params)
        assert (problems == []) == fits, (relay, mem, problems)
        if not fits:
            need = host_need(params, 8, 4, 0, relay=not relay)
            assert problems == [refusal("hpc/the allocation's first node (--mem=1G)", need,
                                        1 << 30, params)]
            assert f"{need / (1 << 30):.2f} GiB" in problems[0]
    on_node = host_need(params, 8, 4, 0, relay=True)
    assert on_node > host_need(params, 8, 4, 0, relay=False)  # the relay counted where it runs
