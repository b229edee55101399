"""pytest fixtures for the test bed (a plugin: `pytest_plugins = ["testbed.fixtures"]`).

- `testbed` (session): one bed per pytest session with clusters east (e1, e2), west (w1, w2),
  north (n1, n2), a bastion, and 100 Mbit/s between every pair of clusters; when Slurm is
  installed (TestBed.slurm_available()) also cluster hpc: Slurm login node and controller `login`
  (SSH) and compute nodes c1, c2 (slurmd, no SSH), see slurm.py. Skips with the reason
  when the machine cannot build one (not root, no sshd, ...). Torn down at session end, also
  when tests fail; an atexit hook is the safety net, and the next run's cleanup_stale() removes
  what a killed session left behind.
- `bed_clean` (function): the session bed, checked after the test: no stray processes in its
  namespaces, no host cut, no sshd stopped, rates back to 100 Mbit/s. A dirty bed is put back
  in order (reset()) and the test errors with what was left; Slurm jobs still pending or running
  are leaks too (reset() cancels them).
- `slurm_bed` (function): `bed_clean`, skipped with the reason when the bed has no Slurm.
- `make_testbed` (function): a factory for extra beds of any layout, torn down after the test.

Bed files live under /tmp/nebula-testbed/<id>/, not under pytest's tmp_path: concurrent pytest
sessions prune each other's old base temp dirs, and sshd re-reads its config and host key on every
connection.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable, Iterator

import pytest

from .bed import TestBed

SESSION_CLUSTERS = {"east": ["e1", "e2"], "west": ["w1", "w2"], "north": ["n1", "n2"]}
SLURM_CLUSTERS = {"hpc": ["login", "c1", "c2"]}  # added when Slurm is available
SESSION_SLURM = {"hpc": "login"}  # cluster -> its login node (the controller runs there too)
SESSION_RATE_MBIT = 100.0
LEAK_GRACE_S = 3.0  # sshd session processes take a moment to exit after the client does


def _skip_unless_available() -> None:
    ok, reason = TestBed.available()
    if not ok:
        pytest.skip(f"test bed unavailable: {reason}")


@pytest.fixture(scope="session")
def testbed() -> Iterator[TestBed]:
    """The session's test bed (see the module docstring)."""
    _skip_unless_available()
    with_slurm, _ = TestBed.slurm_available()
    bed = TestBed({**SESSION_CLUSTERS, **(SLURM_CLUSTERS if with_slurm else {})},
                  rate_mbit=SESSION_RATE_MBIT, bastion=True,
                  slurm=SESSION_SLURM if with_slurm else None)
    atexit.register(bed.down)
    try:
        bed.up()
        yield bed
    finally:
        bed.down()
        atexit.unregister(bed.down)


def _checked_clean(testbed: TestBed) -> Iterator[TestBed]:
    yield testbed
    deadline = time.monotonic() + LEAK_GRACE_S
    while (leaks := testbed.leaks()) and time.monotonic() < deadline:
        time.sleep(0.1)
    testbed.reset()
    if leaks:
        pytest.fail("the test left the test bed dirty: " + "; ".join(leaks), pytrace=False)


@pytest.fixture
def bed_clean(testbed: TestBed) -> Iterator[TestBed]:
    """The session bed; after the test, errors if the test left it dirty (and cleans it)."""
    yield from _checked_clean(testbed)


@pytest.fixture
def slurm_bed(testbed: TestBed) -> Iterator[TestBed]:
    """`bed_clean` with its Slurm cluster (`bed.slurm`); skips when the bed has none."""
    if testbed.slurm is None:
        _, reason = TestBed.slurm_available()
        pytest.skip(f"Slurm unavailable: {reason or 'the session bed was built without it'}")
    yield from _checked_clean(testbed)


@pytest.fixture
def make_testbed() -> Iterator[Callable[..., TestBed]]:
    """make_testbed(clusters=..., rate_mbit=..., bastion=...) -> a bed that is up; all beds
    made are torn down after the test."""
    _skip_unless_available()
    beds: list[TestBed] = []

    def make(clusters: dict[str, list[str]] | None = None, **kwargs) -> TestBed:
        bed = TestBed(clusters, **kwargs)
        beds.append(bed)
        return bed.up()

    try:
        yield make
    finally:
        for bed in beds:
            bed.down()
