"""What the test bed does on this machine: run a command, the bed's addresses, network namespaces
and the processes in them, background processes, TCP ports (root only).

Addresses, all inside 198.18.0.0/15 (nothing else is ever configured or targeted): each live bed
holds one of 8 slots (a /18, slot s starts at 198.18.0.0 + s * 16384); within it /24 number i is
cluster i (in dict order), /24 number 32 the bastion net, /24 number 33 the mgmt net. For slot 0:
east 198.18.0.0/24 (e1 .1, e2 .2, router .254), west 198.18.1.0/24, north 198.18.2.0/24,
bastion 198.18.32.1, root 198.18.33.1, router 198.18.33.2. The root namespace reaches every host
and the bastion directly through the router (route <slot /18> via mgmt .2); hosts have no default
route, so nothing they send can leave the slot.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

BENCH_NET = ipaddress.IPv4Network("198.18.0.0/15")
SLOTS = 8
SLOT_SIZE = 1 << 14  # a /18
HOST_IFACE = "eth0"


class TestBedError(RuntimeError):
    """The test bed could not be built or driven (missing tools, a failed `ip`/`tc` command)."""

    __test__ = False


def _sh(cmd: Sequence[str], *, check: bool = True, timeout: float = 30,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                              input=input, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise TestBedError(f"timed out after {timeout}s: {shlex.join(cmd)}") from exc
    if check and proc.returncode != 0:
        raise TestBedError(f"{shlex.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def slot_net(slot: int) -> ipaddress.IPv4Network:
    """The /18 of addresses that bed slot `slot` owns (inside 198.18.0.0/15)."""
    net = ipaddress.IPv4Network((int(BENCH_NET.network_address) + slot * SLOT_SIZE, 18))
    if not 0 <= slot < SLOTS or not net.subnet_of(BENCH_NET):
        raise TestBedError(f"slot {slot} outside 198.18.0.0/15")
    return net


def subnet(slot: int, index: int) -> ipaddress.IPv4Network:
    """/24 number `index` of a slot: clusters 0..31, bastion 32, mgmt 33."""
    return list(slot_net(slot).subnets(new_prefix=24))[index]


def _addr(net: ipaddress.IPv4Network, host: int) -> str:
    return str(net.network_address + host)


def list_namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    out = _sh(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def kill_pids(pids: Sequence[int], *, grace: float = 3.0) -> None:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL whatever is left (bounded)."""
    pids = [p for p in pids if p != os.getpid()]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 3.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while (pids := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not pids:
            return


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def _stop_popen(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=3)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _readline(proc: subprocess.Popen, *, timeout: float) -> str:
    """One line of proc's stdout, waiting at most `timeout` seconds ("" on timeout or EOF)."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return ""
    return proc.stdout.readline().strip()


def port_open(address: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a TCP connect from this namespace to address:port succeeds (198.18/15 only)."""
    if ipaddress.IPv4Address(address) not in BENCH_NET:
        raise TestBedError(f"{address} is outside 198.18.0.0/15")
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False
