"""bench/scale.py's figures (issue 42), pure and on /proc: a process's peak VmHWM plus its
memfd/shm mappings, its outer-step memory (minus its peak without `relay:` for a rank, or its idle
size before round 1 for a relay), the ratio to its shard's fp32 bytes (planner/outer_memory.py's
`shard_elements`), round time against its bound, and the fit round_s = a + b * params / ranks."""

from __future__ import annotations

from pathlib import Path

from nebula_cli.planner.outer_memory import FP32_BYTES, ProcessRole, shard_elements


def vm_hwm(pid: int) -> int:
    """A process's peak resident size (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"pid {pid}: no VmHWM")


def shared_mappings(pid: int) -> int:
    """Bytes of the process's memfd and /dev/shm mappings (in no RSS's peak: counted apart),
    each mapped file counted once."""
    sizes: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        name = fields[5] if len(fields) == 6 else ""
        if name.startswith("/memfd:") or name.startswith("/dev/shm/"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            sizes[name] = sizes.get(name, 0) + hi - lo
    return sum(sizes.values())


def peak_bytes(pid: int) -> int:
    """The issue's peak: VmHWM plus the memfd/shm mappings."""
    return vm_hwm(pid) + shared_mappings(pid)


def rss_shmem(pid: int) -> int:
    """The process's resident shared-memory pages (RssShmem), in bytes: the memfd and /dev/shm
    pages it touched, which its VmRSS (and so its VmHWM) already counts."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_once_bytes(pid: int) -> int:
    """VmHWM plus only the part of its memfd/shm mappings not already resident in it: the
    issue's peak counts a touched shared page twice (in VmHWM and in the mapping), this one
    once. Read at one instant (the mapped and resident sizes move between samples)."""
    return vm_hwm(pid) + max(0, shared_mappings(pid) - rss_shmem(pid))


def outer_step_bytes(peak: int, baseline: int) -> int:
    """Outer-step memory: the peak minus the baseline (a rank's peak in the same job without
    `relay:`, a relay's idle size before round 1), never below zero."""
    return max(0, peak - baseline)


def vs_shard(outer_bytes: int, params: int, ranks: int, role: ProcessRole) -> float:
    """Outer-step memory in copies of the process's shard's fp32 bytes."""
    return outer_bytes / (shard_elements(params, ranks, role) * FP32_BYTES)


def link_bound_s(payload_bytes: int, mbit: float, rtt_ms: float) -> float:
    """The link's time for a round: bytes / rate + one RTT."""
    return payload_bytes * 8 / (mbit * 1e6) + rtt_ms / 1e3


def round_vs_bound(round_s: float, link_s: float, machine_s: float) -> tuple[float, str]:
    """Round time over its bound (the larger of the link's and this machine's), and which binds."""
    bound, binds = max((link_s, "link"), (machine_s, "machine"))
    return round_s / bound, binds


def steady_round_s(seconds: list[float]) -> float | None:
    """The mean round after the first (which pays the relays' and rank 0's first mappings of
    their shared memory and fresh pages: 2-3x the third at 100 M); all of them when there is
    one. The linear cost is fitted on it."""
    later = seconds[1:] or seconds
    return round(sum(later) / len(later), 4) if later else None


def linear_cost(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(a, b, worst relative miss) of round_s = a + b * params / ranks over (params, ranks,
    round_s) points, fitted by least squares on the relative misses ((a + b x - y) / y: the
    goal's measure): an unweighted fit is set by the largest size's seconds and misses the
    smallest by its whole fixed cost (1.3 M to 100 M: 63 % unweighted, 8 % weighted, on the
    same rounds)."""
    xs = [params / ranks for params, ranks, _ in points]
    ys = [s for _, _, s in points]
    # normal equations of min sum(((a + b x - y) / y)^2): weights w = 1 / y^2
    w = [1.0 / (y * y) for y in ys]
    sw, sx = sum(w), sum(wi * x for wi, x in zip(w, xs, strict=True))
    sy = sum(wi * y for wi, y in zip(w, ys, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys, strict=True))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det if det else 0.0
    a = (sy - b * sx) / sw
    worst = max(abs(a + b * x - y) / y for x, y in zip(xs, ys, strict=True))
    return a, b, worst
