"""bench/_slow_link.py on real sockets: each of several messages sent one after the other
arrives about one delay after it was sent (the delays do not add up), a large message is paced
at the rate, and the far end's close arrives too."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from helpers.bench_modules import load_bench


@dataclass
class Far:
    """The far end of a link under test: what it received, when, and whether it saw the end."""

    got: list[tuple[float, int]] = field(default_factory=list)
    closed: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def through() -> Iterator[Callable[..., tuple[socket.socket, Far]]]:
    """through(delay_ms, rate_mbit): a client socket into a SlowLink to a receiving server."""
    m = load_bench("_slow_link")
    with contextlib.ExitStack() as stack:
        def make(delay_ms: float, rate_mbit: float | None) -> tuple[socket.socket, Far]:
            server = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
            server.settimeout(10)
            far = Far()

            def receive() -> None:
                with contextlib.suppress(OSError), server.accept()[0] as conn:
                    while data := conn.recv(65536):
                        far.got.append((time.monotonic(), len(data)))
                    far.closed.set()

            threading.Thread(target=receive, daemon=True).start()
            link = m.SlowLink(server.getsockname(), delay_ms=delay_ms, rate_mbit=rate_mbit)
            stack.callback(link.close)
            client = stack.enter_context(
                socket.create_connection(("127.0.0.1", link.port), timeout=10))
            return client, far

        yield make


def test_pipelined_messages_each_take_the_delay_once(
        through: Callable[..., tuple[socket.socket, Far]]) -> None:
    client, far = through(1000, None)
    sent = []
    for _ in range(4):  # 0.5 s apart: a reader that slept out each chunk's delay before reading
        sent.append(time.monotonic())  # on would deliver some of them 1.5 s late
        client.sendall(b"x" * 100)
        time.sleep(0.5)
    client.shutdown(socket.SHUT_WR)
    assert far.closed.wait(15)  # the end arrives too
    assert sum(n for _, n in far.got) == 400
    arrived, total = [], 0
    for at, n in far.got:  # message i ends at byte 100 (i + 1)
        total += n
        arrived += [at] * (total // 100 - len(arrived))
    latency = [a - s for a, s in zip(arrived, sent, strict=True)]
    assert all(0.99 <= x <= 1.4 for x in latency), latency  # (slack for a loaded machine)


def test_a_large_message_is_paced_at_the_rate(
        through: Callable[..., tuple[socket.socket, Far]]) -> None:
    client, far = through(10, 8.0)  # 1 MB/s
    start = time.monotonic()
    client.sendall(b"y" * 300_000)
    client.shutdown(socket.SHUT_WR)
    assert far.closed.wait(15)
    assert sum(n for _, n in far.got) == 300_000
    assert far.got[-1][0] - start >= 0.28  # 0.3 s at 1 MB/s (the first chunk's pacing included)
