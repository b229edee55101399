"""A launch is all or nothing: Ctrl-C (a real SIGINT to `nebula launch`) before every agent has
started ends whatever had started, records the job as CANCELLED and exits 130 within 10 s;
`fanout` never leaves its threads behind; the transport cache is safe from threads."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.interrupts import launch_and_interrupt, mentions
from helpers.jobs import CLI, REPO, wait_for, write_spec

from nebula_cli.control.fanout import GroupError, fanout
from nebula_cli.control.session import Session
from nebula_cli.control.state import StateStore
from nebula_cli.transport.local.conn import LocalConn

SPEC = """
name: cancel
workdir: .
setup: {setup}
run: sleep 300
relay: {{}}
clusters:
  - {{name: east, transport: local, python: {python}, hosts: [e1, e2]}}
  - {{name: west, transport: local, python: {python}, hosts: [w1]}}
"""






@pytest.mark.slow
def test_ctrl_c_during_setup_cancels_the_launch(cli: CLI, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, SPEC.format(setup="'echo setting up; sleep 120'",
                                            python=sys.executable))
    job_id, code, seconds = launch_and_interrupt(cli, spec, "setup | setting up")
    assert code == 130 and seconds < 10, (code, seconds)
    status = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert status["state"] == "CANCELLED"
    assert all(h["state"] not in ("PENDING", "RUNNING", "STARTING") for h in status["hosts"])
    assert wait_for(lambda: not mentions(job_id), timeout=5)


@pytest.mark.slow
def test_ctrl_c_while_agents_start_stops_the_relays_already_running(
        cli: CLI, tmp_path: Path) -> None:
    # An interpreter that is slow to start the workers' agents: the relays are up by then.
    slow = tmp_path / "slowpython"
    slow.write_text('#!/bin/sh\n'
                    'case "$*" in *"nebula_cli.agent start "*/worker*) sleep 120;; esac\n'
                    f'exec {sys.executable} "$@"\n')
    slow.chmod(0o755)
    spec = write_spec(tmp_path, SPEC.format(setup="null", python=slow))
    job_id, code, seconds = launch_and_interrupt(cli, spec, "/relay (agent pid")
    assert code == 130 and seconds < 10, (code, seconds)
    status = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert status["state"] == "CANCELLED"
    relays = [h for h in status["hosts"] if h["role"] == "relay"]
    assert len(relays) == 2 and all(h["state"] == "STOPPED" for h in relays)
    assert wait_for(lambda: not mentions(job_id), timeout=5)


def test_fanout_cancels_and_waits_for_what_runs() -> None:
    release = threading.Event()
    started: list[str] = []

    def work(key: str) -> str:
        started.append(key)
        if key == "slow":
            release.wait(30)
            raise ConnectionError("connection closed")
        return key

    t0 = time.monotonic()
    with pytest.raises(GroupError) as info:
        fanout(["fast", "slow"], work, timeout=0.3, cancel=release.set)
    assert time.monotonic() - t0 < 5
    assert info.value.results["fast"] == "fast"
    assert isinstance(info.value.results["slow"], ConnectionError)  # it returned: waited for
    assert not [t for t in threading.enumerate() if t.name.startswith("fanout-")]


def test_fanout_threads_never_keep_the_process_alive() -> None:
    """A call that ignores its cancellation: the first Ctrl-C cancels and waits for it, a
    second one gives up waiting, and the process exits at once (daemon threads)."""
    script = ("import time, sys\nfrom nebula_cli.control.fanout import fanout\n"
              "print('ready', flush=True)\n"
              "fanout([1, 2], lambda k: time.sleep(600), timeout=600, cancel=lambda: None)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None  # still waiting for the call it cancelled
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) != 0  # gone, though its threads still sleep
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_aborted_transport_refuses_further_work(tmp_path: Path) -> None:
    from nebula_cli.errors import TransportError
    from nebula_cli.transport import LocalTransport

    t = LocalTransport("h", home=str(tmp_path))
    box: list[object] = []
    runner = threading.Thread(target=lambda: box.append(_outcome(t, ["sleep", "30"])))
    runner.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    t.abort()
    runner.join(10)
    assert time.monotonic() - t0 < 5 and box and box[0] != 0  # the running command ended
    with pytest.raises(TransportError, match="cancelled"):
        t.run(["true"])


def _outcome(t: object, argv: list[str]) -> object:
    try:
        return t.run(argv, timeout=60).exit_code  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test looks at
        return exc


def test_the_transport_cache_gives_one_transport_per_machine_to_many_threads(
        tmp_path: Path) -> None:
    with StateStore(tmp_path / "home") as store, Session(store) as session:
        conn = LocalConn(name="e1", home=str(tmp_path), python="python3")
        barrier = threading.Barrier(16)
        got: list[object] = []

        def grab() -> None:
            barrier.wait()
            got.append(session.transport(conn))

        threads = [threading.Thread(target=grab) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(got) == 16 and len({id(t) for t in got}) == 1
