"""A planned port is drawn below the ephemeral range, where connections' local ends and other
processes' bind(0) (gloo, torch stores, other jobs) do not take it before the service binds it."""

from __future__ import annotations

import socket
import subprocess

from nebula_cli.transport import freeport
from nebula_cli.transport.local.transport import LocalTransport


def test_a_drawn_port_is_free_and_below_the_ephemeral_range() -> None:
    low = freeport.ephemeral_low()
    ports = {freeport.free_port("127.0.0.1") for _ in range(50)}
    assert all(freeport.LOWEST <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 40  # drawn at random: two launches rarely draw the same
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ports_the_kernel_hands_out_are_never_drawn() -> None:
    """The race it closes: a thousand sockets bound by the kernel's choice (what gloo does for
    every pair of ranks) share no port with the ports drawn meanwhile."""
    taken = []
    try:
        for _ in range(1000):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            taken.append(s)
        kernel = {s.getsockname()[1] for s in taken}
        drawn = {freeport.free_port("127.0.0.1") for _ in range(200)}
        assert not kernel & drawn
    finally:
        for s in taken:
            s.close()


def test_a_port_in_use_is_not_drawn() -> None:
    with socket.socket() as held:
        held.bind(("", 0))
        assert not freeport.bindable(held.getsockname()[1])


def test_without_room_below_the_range_the_kernel_chooses(tmp_path) -> None:
    low = freeport.ephemeral_low()
    port = freeport.free_port("127.0.0.1", lowest=low)  # no room: bind(0)
    assert port >= low
    unreadable = tmp_path / "missing"
    assert freeport.ephemeral_low(str(unreadable)) == 32768


def test_the_remote_snippet_runs_on_a_bare_python() -> None:
    """What SSH and Slurm hosts run: the standard library only, no nebula installed (-I)."""
    out = subprocess.run(["python3", "-I", "-S", "-c", freeport.FREE_PORT_PY],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert freeport.LOWEST <= int(out) < freeport.ephemeral_low()


def test_local_hosts_get_drawn_ports(tmp_path) -> None:
    port = LocalTransport("here", home=str(tmp_path)).listen_port(29400)
    assert freeport.LOWEST <= port < freeport.ephemeral_low()
