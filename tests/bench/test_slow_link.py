"""bench/_slow_link.py on real sockets: each of several messages sent one after the other
arrives about one delay after it was sent (the delays do not add up), a large message is paced
at the rate, and the far end's close arrives too."""

from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("slow_link", REPO / "bench" / "_slow_link.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _receiver(server: socket.socket, got: list[tuple[float, int]], done: threading.Event
              ) -> None:
    conn, _ = server.accept()
    with conn:
        while data := conn.recv(65536):
            got.append((time.monotonic(), len(data)))
    done.set()


def test_pipelined_messages_each_take_the_delay_once() -> None:
    m = _module()
    server = socket.create_server(("127.0.0.1", 0))
    got: list[tuple[float, int]] = []
    done = threading.Event()
    threading.Thread(target=_receiver, args=(server, got, done), daemon=True).start()
    link = m.SlowLink(server.getsockname(), delay_ms=300, rate_mbit=None)
    try:
        client = socket.create_connection(("127.0.0.1", link.port))
        sent = []
        for _ in range(5):  # 150 ms apart: a reader that slept out each chunk's delay before
            sent.append(time.monotonic())  # reading on would deliver some 450 ms late
            client.sendall(b"x" * 100)
            time.sleep(0.15)
        client.close()
        assert done.wait(10)
    finally:
        link.close()
        server.close()
    assert sum(n for _, n in got) == 500
    arrived, total = [], 0
    for at, n in got:  # message i ends at byte 100 (i + 1)
        total += n
        arrived += [at] * (total // 100 - len(arrived))
    latency = [a - s for a, s in zip(arrived, sent, strict=True)]
    assert all(0.29 <= x <= 0.42 for x in latency), latency  # (slack for a loaded machine)


def test_a_large_message_is_paced_at_the_rate() -> None:
    m = _module()
    server = socket.create_server(("127.0.0.1", 0))
    got: list[tuple[float, int]] = []
    done = threading.Event()
    threading.Thread(target=_receiver, args=(server, got, done), daemon=True).start()
    link = m.SlowLink(server.getsockname(), delay_ms=10, rate_mbit=8.0)  # 1 MB/s
    try:
        client = socket.create_connection(("127.0.0.1", link.port))
        start = time.monotonic()
        client.sendall(b"y" * 300_000)
        client.close()
        assert done.wait(10)
    finally:
        link.close()
        server.close()
    assert sum(n for _, n in got) == 300_000
    assert got[-1][0] - start >= 0.28  # 0.3 s at 1 MB/s (the first chunk's pacing included)
