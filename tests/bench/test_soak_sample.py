"""bench/_soak_sample.py on real processes: a process that grows by a known amount per "round"
is measured at that slope, a flat one at about zero, and a fit leaves out samples taken while a
kind had fewer processes than usual (a restart)."""

from __future__ import annotations

import subprocess
import sys
import time

from helpers.bench_modules import load_bench

GROWER = """
import sys, time
held = []
for line in sys.stdin:
    held.append(bytearray(int(line)))  # touched: resident
    for i in range(0, len(held[-1]), 4096):
        held[-1][i] = 1
    print("ok", flush=True)
"""


def test_growth_per_1000_rounds_of_a_real_process() -> None:
    m = load_bench("_soak_sample")
    proc = subprocess.Popen([sys.executable, "-c", GROWER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    samples = []
    try:
        for i in range(8):  # 2 MiB more per 500 rounds: 4 MiB per 1,000 rounds
            proc.stdin.write(f"{2 << 20}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "ok"
            time.sleep(0.05)
            samples.append(m.Sample(t=i, rounds=500 * i, rss={**dict.fromkeys(m.KINDS, 0.0),
                                                               "relay": m.rss_mib(proc.pid)},
                                    fds={**dict.fromkeys(m.KINDS, 3), "relay": m.fds(proc.pid)},
                                    count={**dict.fromkeys(m.KINDS, 1)}))
    finally:
        proc.kill()
        proc.wait()
    restarting = m.Sample(t=9, rounds=4500, rss=dict.fromkeys(m.KINDS, 0.0),
                          fds=dict.fromkeys(m.KINDS, 0), count=dict.fromkeys(m.KINDS, 0))
    grown = m.growth([*samples, restarting], warmup=0.2)
    assert 3.5 <= grown["rss_mb"]["relay"] <= 4.5
    assert grown["rss_mb"]["agent"] == 0.0 and grown["fds"]["relay"] == 0.0
    assert m.slope([0, 1, 2], [1, 3, 5]) == 2.0 and m.slope([1], [1]) == 0.0


def test_a_restart_is_neither_growth_nor_shrinking() -> None:
    m = load_bench("_soak_sample")
    samples = []
    for i in range(12):  # pid 10 lives 6 samples, then its restart (pid 11) starts small
        pid, age = (10, i) if i < 6 else (11, i - 6)
        rss = 500.0 - 400.0 * (pid == 11) + 0.2 * age  # 0.2 MiB per 100 rounds: 2 per 1,000
        samples.append(m.Sample(t=i, rounds=100 * i, rss=dict.fromkeys(m.KINDS, rss),
                                fds=dict.fromkeys(m.KINDS, 9), count=dict.fromkeys(m.KINDS, 1),
                                per_pid={"worker": {pid: (rss, 9)}}))
    grown = m.growth(samples, warmup=0.2)
    assert 1.9 <= grown["rss_mb"]["worker"] <= 2.1  # not the -400 MiB of the restart
    assert grown["fds"]["worker"] == 0.0


def test_a_fit_says_how_sure_it_is() -> None:
    m = load_bench("_soak_sample")
    exact = m.fit([0, 1, 2, 3], [1, 3, 5, 7])
    assert exact.slope == 2.0 and exact.stderr == 0.0
    noisy = m.fit([0, 1, 2, 3, 4, 5], [0, 1.5, 1.5, 3.5, 3.5, 5])  # slope ~1, residuals ~0.4
    assert 0.9 <= noisy.slope <= 1.1 and 0.05 <= noisy.stderr <= 0.2
    assert m.fit([1], [1]) == m.Fit(0.0, 0.0) and m.fit([2, 2, 2], [1, 2, 3]).slope == 0.0
    points = {7: [(0, 10.0, 3), (100, 10.5, 3)], 8: [(100, 20.0, 4)]}
    samples = [m.Sample(t=i, rounds=r, per_pid={"relay": {pid: (rss, fd) for pid, pts in
                                                          points.items() for rr, rss, fd in pts
                                                          if rr == r}})
               for i, r in enumerate((0, 100))]
    assert m.lives(samples, "relay") == {7: [(0, 10.0, 3), (100, 10.5, 3)], 8: [(100, 20.0, 4)]}
    assert m.lives(samples, "worker") == {}
