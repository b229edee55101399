"""Which port a service of the job will listen on: one free now, and unlikely to be taken before
the service binds it.

A port is planned at launch and bound later (a relay, a rendezvous store, a label relay start
after the plan is written and shipped), and other hosts are told it in between. The kernel's
``bind(('', 0))`` answers from the ephemeral range (``net.ipv4.ip_local_port_range``, 32768-60999
by default): the range every outgoing connection's local end and every other ``bind(0)``
(gloo's pair sockets, torch's stores, other jobs) is drawn from, so on a busy host the planned
port is often someone's by the time the service binds it. `free_port` therefore draws a random
port *below* the ephemeral range (from `LOWEST` up), checks that it binds, and falls back to
``bind(0)`` only where the ephemeral range leaves no room below it.

The functions use the standard library only: `FREE_PORT_PY` is their source, run on a remote
host under the cluster's python (where nebula may not be installed yet); it prints the port.
"""

from __future__ import annotations

import inspect
import random
import socket

LOWEST = 20000
"""The lowest port drawn: above the registered ports most services use by default."""
TRIES = 64
"""Random ports tried before falling back to the kernel's choice."""
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_low(path: str = EPHEMERAL_RANGE) -> int:
    """The first port of the host's ephemeral range (Linux's default where unreadable)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(port: int, address: str = "") -> bool:
    """Whether a TCP socket can bind `port` on `address` now."""
    with socket.socket() as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def free_port(address: str = "", lowest: int = LOWEST, tries: int = TRIES) -> int:
    """A port free on `address`, drawn below the ephemeral range where there is room."""
    high = ephemeral_low() - 1
    draw = random.SystemRandom()
    for _ in range(tries if high > lowest else 0):
        port = draw.randint(lowest, high)
        if bindable(port, address):
            return port
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


FREE_PORT_PY = "\n".join([
    "import random, socket",
    f"EPHEMERAL_RANGE = {EPHEMERAL_RANGE!r}",
    f"LOWEST = {LOWEST}",
    f"TRIES = {TRIES}",
    *(inspect.getsource(f) for f in (ephemeral_low, bindable, free_port)),
    "print(free_port())",
])
"""Prints a port free on the host it runs on (see `free_port`)."""
