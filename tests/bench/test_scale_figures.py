"""bench/_scale_figures.py: a real process that maps a memfd of known size and touches a known
amount of memory is measured at those sizes; the ratio, the bound and the linear fit."""

from __future__ import annotations

import subprocess
import sys

from helpers.bench_modules import load_bench

from nebula_cli.planner.outer_memory import FP32_BYTES, ProcessRole

MIB = 1 << 20
CHILD = """
import mmap, os, sys
fd = os.memfd_create("scale-test")
os.ftruncate(fd, 64 << 20)
shared = mmap.mmap(fd, 64 << 20)
own = bytearray(96 << 20)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_peak_counts_vm_hwm_and_the_memfd_once() -> None:
    m = load_bench("_scale_figures")
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert m.shared_mappings(child.pid) == 64 * MIB
        assert m.vm_hwm(child.pid) >= 96 * MIB
        assert m.peak_bytes(child.pid) == m.vm_hwm(child.pid) + 64 * MIB
        assert m.rss_shmem(child.pid) < MIB  # mapped, never touched
        assert m.peak_once_bytes(child.pid) >= m.vm_hwm(child.pid) + 63 * MIB
    finally:
        child.kill()
        child.wait()


def test_a_touched_memfd_is_counted_once() -> None:
    m = load_bench("_scale_figures")
    child = subprocess.Popen([sys.executable, "-c", CHILD.replace(
        'print("ready"', 'shared[:] = bytes(64 << 20)\nprint("ready"')],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert m.rss_shmem(child.pid) >= 63 * MIB  # in VmHWM already
        assert m.peak_once_bytes(child.pid) < m.vm_hwm(child.pid) + MIB
        assert m.peak_bytes(child.pid) >= m.vm_hwm(child.pid) + 64 * MIB  # twice
    finally:
        child.kill()
        child.wait()


def test_ratio_bound_and_fit() -> None:
    m = load_bench("_scale_figures")
    params = 1_000_000
    assert m.outer_step_bytes(10, 25) == 0
    assert m.vs_shard(7 * params * FP32_BYTES, params, 2, ProcessRole.RELAY) == 7.0
    assert abs(m.link_bound_s(125_000_000, 1000.0, 20.0) - 1.02) < 1e-9
    assert m.round_vs_bound(3.0, 1.0, 2.0) == (1.5, "machine")
    a, b, worst = m.linear_cost([(p, r, 0.5 + 2e-7 * p / r)
                                 for p, r in ((1_000_000, 1), (8_000_000, 2), (20_000_000, 4))])
    assert abs(a - 0.5) < 1e-9 and abs(b - 2e-7) < 1e-15 and worst < 1e-9
    # the steady rounds measured at 1.3 M, 20 M and 100 M (2 ranks): the relative misses fitted
    a, b, worst = m.linear_cost([(1_298_880, 2, 0.1111), (19_111_936, 2, 1.0941),
                                 (99_526_656, 2, 4.7277)])
    assert abs(a - 0.0468) < 1e-3 and abs(b - 1.0019e-7) < 1e-10 and 0.08 < worst < 0.085


def test_the_steady_round_leaves_the_first_out() -> None:
    m = load_bench("_scale_figures")
    assert m.steady_round_s([17.8, 9.84, 6.26]) == 8.05  # (the first maps its memory)
    assert m.steady_round_s([2.0]) == 2.0 and m.steady_round_s([]) is None
