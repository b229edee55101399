"""Shared fixtures: an isolated NEBULA_HOME, a CLI runner, and a sweep for leftover processes."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.jobs import (
    CLI,
    REMOTE_JOBS,
    kill_job_processes,
)
from testbed import TestBed

pytest_plugins = ["testbed.fixtures", "helpers.sshd_bed"]  # the bed fixtures; `bed`: one sshd

# A suite started in the background (`./scripts/test.sh &`, nohup, a CI runner's shell) may
# start with SIGINT ignored, and an ignored signal stays ignored across exec: every `nebula
# launch` a test interrupts with a real SIGINT would then go on as if no Ctrl-C came, and the
# tests of Ctrl-C fail with timeouts. Catching it here makes the children's SIGINT the default
# again (a caught signal is reset at exec), as it is in a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def nebula_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "nebula-home"
    monkeypatch.setenv("NEBULA_HOME", str(home))
    return home


@pytest.fixture
def cli(nebula_home: Path) -> Iterator[CLI]:
    """Runs `nebula` in a subprocess against an isolated NEBULA_HOME; ends every job after."""
    env = {**os.environ, "NEBULA_HOME": str(nebula_home), "COLUMNS": "200", "NO_COLOR": "1"}
    runner = CLI(home=nebula_home, env=env)
    try:
        yield runner
    finally:
        for job_id in runner.job_ids():
            try:  # a stop that fails or hangs must still leave nothing running
                runner("stop", job_id, "--force", timeout=120)
            finally:
                kill_job_processes(job_id)


@pytest.fixture
def ssh_cli(cli: CLI, bed_clean: TestBed) -> Iterator[CLI]:
    """The CLI, with the bed's ssh_config and known_hosts; remote job dirs removed after."""
    cli.env["NEBULA_SSH_CONFIG"] = str(bed_clean.ssh_config)
    cli.env["NEBULA_KNOWN_HOSTS"] = str(bed_clean.known_hosts)
    yield cli
    for job_id in cli.job_ids():  # the cli fixture stops the jobs; their files go here
        shutil.rmtree(REMOTE_JOBS / job_id, ignore_errors=True)


