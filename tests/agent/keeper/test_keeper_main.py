"""`python -m nebula_cli.agent.keeper`, the keeper's name before it moved to
`nebula_cli.schedulers.slurm.keeper`, still runs it: batch scripts submitted by earlier
versions serve under it, and the CLI calls it by it (a running job's nodes run that job's
uploaded copy). Real processes and a real socket file, in a home of the test's."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

OLD, NEW = "nebula_cli.agent.keeper", "nebula_cli.schedulers.slurm.keeper"


@pytest.fixture
def home() -> Iterator[dict[str, str]]:
    where = Path(tempfile.mkdtemp(prefix="nebula-keeper-main-", dir="/tmp"))
    try:
        yield {**os.environ, "HOME": str(where), "PYTHONPATH": os.getcwd()}
    finally:
        shutil.rmtree(where, ignore_errors=True)


def call(module: str, name: str, env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, "call", name, "--env-json",
                           json.dumps({"X_FROM_CALLER": module}), "--", sys.executable, "-c",
                           code], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("caller", [OLD, NEW])
def test_a_keeper_served_by_its_old_name_answers_either_name(home: dict[str, str],
                                                             caller: str) -> None:
    name = "main-" + secrets.token_hex(4)
    proc = subprocess.Popen([sys.executable, "-m", OLD, "serve", name, "--idle-timeout", "30",
                             "--exit-after-notice"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=home)
    try:
        assert "ready" in (proc.stdout.readline() if proc.stdout else ""), proc.stderr
        socks = list((Path(home["HOME"]) / ".nebula" / "keepers").glob(f"{name}@*.sock"))
        assert len(socks) == 1, socks
        out = call(caller, name, home, "import os, sys; print(os.environ['X_FROM_CALLER']); "
                                       "sys.exit(7)")
        assert (out.returncode, out.stdout.strip()) == (7, caller), out.stderr
        proc.send_signal(signal.SIGTERM)  # Slurm's notice: a keeper with no agents leaves
        assert proc.wait(timeout=60) == 0
        assert not socks[0].exists()  # it removed its own socket file
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def test_the_old_name_is_the_new_keepers_command_line(home: dict[str, str]) -> None:
    old, new = (subprocess.run([sys.executable, "-m", m, "--help"], capture_output=True,
                               text=True, timeout=60, env=home) for m in (OLD, NEW))
    assert old.returncode == new.returncode == 0, (old.stderr, new.stderr)
    assert old.stdout == new.stdout and "nebula-keeper" in old.stdout
