"""bench/_distill_site.py on real processes: a link site comes up pinned where it was told,
carries bytes to its target, and is gone when its block ends; a site that cannot come up says
so instead of hanging the bench."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _module() -> ModuleType:
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("distill_site", REPO / "bench" /
                                                  "_distill_site.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_link_site_carries_bytes_on_its_cpu_and_ends_with_its_block() -> None:
    m = _module()
    server = socket.create_server(("127.0.0.1", 0))
    cpu = min(os.sched_getaffinity(0))
    with m.site("link", "127.0.0.1", str(server.getsockname()[1]), "10",
                cpus={cpu}) as (proc, line):
        assert line.startswith("port ")
        assert proc.pid in m.site_processes()
        assert os.sched_getaffinity(proc.pid) == {cpu}
        client = socket.create_connection(("127.0.0.1", int(line.split()[1])), timeout=10)
        conn, _ = server.accept()
        client.sendall(b"soft labels")
        conn.settimeout(10)
        assert conn.recv(64) == b"soft labels"
        client.close()
        conn.close()
    assert proc.poll() is not None  # ended with the block
    assert proc.pid not in m.site_processes()
    server.close()


def test_a_site_that_cannot_start_says_so(tmp_path: Path) -> None:
    m = _module()
    with pytest.raises(RuntimeError, match="did not come up"), \
            m.site("teacher", str(tmp_path / "missing.json"), str(tmp_path / "w.pt"), "8", "8",
                   "1", "8"):
        pass
