"""nebula_cli/heap.py: freed memory given back to the system, at most once per interval."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from nebula_cli.heap import HeapTrim

pytestmark = pytest.mark.skipif(not HeapTrim().supported,
                                reason="no malloc_trim in this C library (not glibc)")

KEPT = textwrap.dedent("""
    import threading
    import torch
    from nebula_cli.heap import HeapTrim

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    kept = []

    def work():  # a round's tensors, made and freed on threads of their own, and a little
        for _ in range(40):  # that lives on (a record, a frame) after each
            parts = [torch.randn(1_300_000) for _ in range(6)]
            kept.append(torch.randn(1000))
            del parts

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    before = rss()
    print(before, HeapTrim().trim(), rss())
""")


def test_what_threads_freed_is_given_back() -> None:
    """Six threads make and free 31 MB of tensors 40 times, keeping 4 KB each time: glibc
    keeps what they freed in their arenas (hundreds of MB resident, 24 MB live); a trim gives
    it back."""
    out = subprocess.run([sys.executable, "-c", KEPT], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    before, trimmed, after = float(out[0]), out[1] == "True", float(out[2])
    assert trimmed and before - after > 200 and after < before / 2, (before, after)


def test_at_most_one_trim_per_interval() -> None:
    now = [0.0]
    heap = HeapTrim(every=10.0, clock=lambda: now[0])
    calls: list[int] = []
    heap._fn = lambda pad: calls.append(pad) or 1  # counted; the real one is tested above
    assert heap.trim() and calls == [0]
    now[0] = 9.0
    assert not heap.trim() and calls == [0]
    now[0] = 10.5
    assert heap.trim() and calls == [0, 0] and heap.trims == 2
