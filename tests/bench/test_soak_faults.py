"""bench/_soak_faults.py on real processes, sockets and file systems: a relay frozen and thawed
after its hold (or at close), a link cut by nftables (connects time out, an open connection's
bytes wait and arrive once restored), one host's checkpoint volume full while the other's
is not."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from helpers.bench_modules import load_bench

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (nftables, tmpfs mounts)")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _comes_to(pid: int, stopped: bool, within: float = 5.0) -> bool:
    """Whether the process is (or is not) stopped within `within` s (a signal lands later)."""
    deadline = time.monotonic() + within
    while (_state(pid) == "T") != stopped:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def fake_relay(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A process that bench/_soak_sample.py takes for a job's relay on east's host."""
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    agent_dir = tmp_path / "jobs" / job_id / "east" / "e1" / "relay"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "nebula_cli.relay"],
        env={**os.environ, "NEBULA_JOB_ID": job_id, "NEBULA_AGENT_DIR": str(agent_dir)})
    try:
        yield job_id, proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_stalled_relay_is_thawed_after_its_hold_and_at_close(
        fake_relay: tuple[str, int], tmp_path: Path) -> None:
    m = load_bench("_soak_faults")
    job_id, pid = fake_relay
    deadline = time.monotonic() + 10
    while b"nebula_cli.relay" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the fake relay never ran"
        time.sleep(0.02)  # (still the fork's copy of pytest)
    inj = m.Injector(job_id, tmp_path / "jobs" / job_id, None)
    assert inj.inject("stall-relay", "east", hold_s=0.5)
    assert _comes_to(pid, stopped=True)
    assert not inj.inject("stall-relay", "east", hold_s=0.5)  # in force already: not twice
    assert inj.due() == [] and inj.pending()
    time.sleep(0.6)
    assert inj.due() == ["stall-relay"]
    assert _comes_to(pid, stopped=False) and not inj.pending()
    assert inj.inject("stall-relay", "east", hold_s=3600)
    assert _comes_to(pid, stopped=True)
    assert inj.due(everything=True) == ["stall-relay"]  # (before a stop, at the end)
    assert _comes_to(pid, stopped=False)
    assert inj.inject("stall-relay", "east", hold_s=3600)
    assert _comes_to(pid, stopped=True)
    inj.close()  # the bench's end, whatever happened: nothing is left frozen
    assert _comes_to(pid, stopped=False) and not inj.pending()
    assert not inj.inject("stall-relay", "west", hold_s=1)  # no relay there


def test_relay_ports_are_read_from_each_relays_config(tmp_path: Path) -> None:
    m = load_bench("_soak_faults")
    for cluster, port in (("east", 26741), ("west", 30828)):
        d = tmp_path / cluster / "h" / "relay"
        d.mkdir(parents=True)
        (d / "relay.json").write_text(json.dumps({"peer_listen": f"127.0.0.1:{port}"}))
    assert m.relay_ports(tmp_path) == [26741, 30828]


@pytest.fixture
def nft_cut() -> Iterator[ModuleType]:
    """The module, with its nftables table deleted after the test whatever happened."""
    m = load_bench("_soak_faults")
    try:
        yield m
    finally:
        subprocess.run(["nft", "delete", "table", "inet", m.NFT_TABLE], capture_output=True)


@root_only
@pytest.mark.skipif(shutil.which("nft") is None, reason="no nft")
def test_a_cut_link_is_silent_and_restored(nft_cut: ModuleType) -> None:
    m = nft_cut
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        server.settimeout(10)
        port = server.getsockname()[1]
        client = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
        peer = stack.enter_context(server.accept()[0])
        undo = m.cut([port])
        probe = stack.enter_context(socket.socket())
        probe.settimeout(1.0)
        with pytest.raises(TimeoutError):
            probe.connect(("127.0.0.1", port))  # no answer at all: silent, not refused
        client.sendall(b"during the cut")
        peer.settimeout(1.0)
        with pytest.raises(TimeoutError):
            peer.recv(64)
        undo()
        peer.settimeout(10.0)  # TCP retransmits: the bytes sent during the cut arrive
        assert peer.recv(64) == b"during the cut"
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert m.NFT_TABLE not in listed
    m.uncut()  # restoring a link that is up is no error


@root_only
def test_one_hosts_volume_fills_and_empties(tmp_path: Path) -> None:
    m = load_bench("_soak_faults")
    volumes = m.CheckpointVolumes(tmp_path)
    try:
        volumes.mount("job-x", {"east": "e1", "west": "w1"})
        east, west = volumes.of("job-x", "east"), volumes.of("job-x", "west")
        assert east == tmp_path / "job-x" / "east" / "e1" and west is not None
        assert east.stat().st_mode & 0o777 == 0o700  # checkpoints load only from such a dir
        undo = m.fill(east)
        with pytest.raises(OSError, match="No space"):
            (east / "step10").write_bytes(b"\0" * (1 << 20))
        (west / "step10").write_bytes(b"\0" * (1 << 20))  # the other host's disk is not full
        undo()
        (east / "step10").write_bytes(b"\0" * (1 << 20))
    finally:
        volumes.close()
    assert not any((tmp_path / "job-x" / "east" / "e1").iterdir())  # unmounted: its files went
    assert str(tmp_path) not in Path("/proc/mounts").read_text()
