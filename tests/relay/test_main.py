"""``python -m nebula_cli.relay`` (relay/__main__.py) as a real process: a relay whose planned
port another process holds waits for it (relay/net/listen.py); SIGTERM during that wait ends it
at once with exit 0 (a stop asked for), not after the whole wait with a "cannot listen"."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers.jobs import REPO
from helpers.relays import Job


def test_sigterm_while_the_relay_waits_for_its_port_stops_it_at_once_and_cleanly(
        tmp_path: Path) -> None:
    job = Job(tmp_path, ["a", "b"])
    host, port = job.peer["a"].rsplit(":", 1)
    cfg_path = tmp_path / "relay-a.json"
    job.cfg["a"].dump(cfg_path)
    log_path = tmp_path / "relay-a.log"
    with socket.create_server((host, int(port))) as holder, open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nebula_cli.relay", "--config",
                                 str(cfg_path)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO)
        try:
            deadline = time.monotonic() + 60
            while "is in use" not in log_path.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, log_path.read_text()
                time.sleep(0.1)
            assert "is in use" in log_path.read_text()
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=20)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert holder.fileno() >= 0
    said = log_path.read_text()
    assert code == 0, said
    assert took < 5.0, (took, said)  # not the 60 s wait
    assert "stopped before it was up" in said and "told to stop while it waited" in said
