"""relay/net/listen.py: a relay's planned port held by another socket (a real one on loopback,
in a child process) is waited for, its holder named, and given up on after the wait with the
holder and the fix in the error."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time

import pytest

from nebula_cli.errors import NebulaError
from nebula_cli.relay.net.listen import holders, listen_tcp

HOLD = """\
import socket, sys, time
s = socket.create_server(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
time.sleep(float(sys.argv[1]))
"""


def _holder(seconds: float) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_a_port_held_for_good_is_given_up_on_naming_its_holder() -> None:
    proc, port = _holder(30)
    try:
        assert f"pid {proc.pid} (" in holders(port)
        t0 = time.monotonic()
        with pytest.raises(NebulaError) as err:
            listen_tcp("127.0.0.1", port, wait=1.0)
        assert 1.0 <= time.monotonic() - t0 < 5.0
        assert f"127.0.0.1:{port}: in use for 1 s (by pid {proc.pid} (" in str(err.value)
        assert "relaunch the job" in str(err.value)
    finally:
        proc.kill()
        proc.wait()


def test_a_port_that_comes_free_within_the_wait_is_taken(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="nebula.relay")
    proc, port = _holder(1.5)
    try:
        sock = listen_tcp("127.0.0.1", port, wait=30.0)
        with sock:
            assert sock.getsockname() == ("127.0.0.1", port)
    finally:
        proc.kill()
        proc.wait()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"127.0.0.1:{port} is in use (by pid {proc.pid} (" in said[0]


def test_another_error_is_not_waited_for() -> None:
    t0 = time.monotonic()
    with pytest.raises(NebulaError, match="relay cannot listen on 192.0.2.1:"):
        listen_tcp("192.0.2.1", 20000, wait=30.0)  # an address this host does not have
    assert time.monotonic() - t0 < 2.0


def test_holders_of_a_port_nobody_holds_is_empty() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert holders(port) == ""  # bound, then closed: nobody holds it


def test_a_relay_told_to_stop_while_it_waits_leaves_at_once_and_scans_proc_twice() -> None:
    """The holder is looked up when it is said (once in the log, once in the error), not at
    every try; a stop (the relay's `stopping`, set by SIGTERM) ends the wait within a try."""
    proc, port = _holder(30)
    stopping, looked = threading.Event(), []

    def who(p: int) -> str:
        looked.append(p)
        return holders(p)

    try:
        threading.Timer(1.6, stopping.set).start()  # after three tries or so
        t0 = time.monotonic()
        with pytest.raises(NebulaError, match="told to stop while it waited") as err:
            listen_tcp("127.0.0.1", port, wait=60.0, stopping=stopping, who=who)
        assert time.monotonic() - t0 < 3.0
        assert f"(by pid {proc.pid} (" in str(err.value)
        assert looked == [port, port]
    finally:
        proc.kill()
        proc.wait()
