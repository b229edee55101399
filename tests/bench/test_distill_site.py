"""bench/_distill_site.py on real processes: a link site comes up pinned where it was told,
carries bytes to its target, and is gone when its block ends; a site that cannot come up says
so instead of hanging the bench."""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
from helpers.bench_modules import load_bench


def test_a_link_site_carries_bytes_on_its_cpu_and_ends_with_its_block() -> None:
    m = load_bench("_distill_site")
    cpu = min(os.sched_getaffinity(0))
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        server.settimeout(10)
        proc, line = stack.enter_context(m.site(
            "link", "127.0.0.1", str(server.getsockname()[1]), "10", cpus={cpu}))
        assert line.startswith("port ")
        assert os.sched_getaffinity(proc.pid) == {cpu}
        assert m.site_processes() == [proc.pid]
        client = stack.enter_context(
            socket.create_connection(("127.0.0.1", int(line.split()[1])), timeout=10))
        conn = stack.enter_context(server.accept()[0])
        client.sendall(b"soft labels")
        conn.settimeout(10)
        assert conn.recv(64) == b"soft labels"
        stack.close()  # the sockets, the site (its process killed), the server
        assert proc.poll() is not None
    assert m.site_processes() == []


def test_a_site_that_cannot_start_says_so() -> None:
    m = load_bench("_distill_site")
    with pytest.raises(RuntimeError, match="did not come up"), \
            m.site("link", "127.0.0.1", "not-a-port", "10"):
        pass
    assert m.site_processes() == []
