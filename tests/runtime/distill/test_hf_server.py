"""The built-in teacher server's model: a directory (the default) is loaded with the hub
switched off, and one that is not there is said at once with the host, the path and the fixes,
where it had been taken for a hub id and retried as a download for a minute (examples/distill
launched before its teacher was saved)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.label_teacher import distill_cfg, job_pki

from nebula_cli.config import strict
from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV
from nebula_cli.runtime.distill.hf_server import OFFLINE_ENV, local_model

HUB_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")


def server(tmp_path: Path, model: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cfg = distill_cfg(job_pki(tmp_path / "pki"), "lab", "t1", teachers={},
                      listen="127.0.0.1:1", model=model, batch_tokens=64)
    (tmp_path / "t.json").write_bytes(strict.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if k not in HUB_ENV}  # as a user's host has it
    return subprocess.run([sys.executable, "-m", "nebula_cli.runtime.distill.hf_server"],
                          env=env | {DISTILL_CONFIG_ENV: str(tmp_path / "t.json")}, cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_a_teacher_directory_that_is_not_there_is_said_at_once(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    started = time.monotonic()
    proc = server(tmp_path, "distill/teacher", work)  # looks like a hub id `org/name`
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr[-2000:]
    said = " ".join(proc.stderr.split())
    assert (f"cluster lab on {socket.gethostname()}: no Hugging Face model at distill/teacher "
            f"in {work} (no such directory)") in said, said
    assert "model.save_pretrained(...)" in said and "`teacher: {hub: true}`" in said
    assert "huggingface.co" not in said and took < 60, (took, said)  # never asked the hub


def test_a_directory_without_config_json_is_no_model(tmp_path: Path) -> None:
    (tmp_path / "teacher").mkdir()
    proc = server(tmp_path, str(tmp_path / "teacher"), tmp_path)
    assert proc.returncode == 1
    assert f"no Hugging Face model at {tmp_path / 'teacher'} (no config.json in it)" in \
        " ".join(proc.stderr.split())


def test_a_model_directory_is_loaded_with_the_hub_switched_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "config.json").write_text("{}")
    for name in HUB_ENV:  # set, then removed: monkeypatch restores (removes) what it set
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    cfg = distill_cfg(tmp_path, "lab", "t1", teachers={}, model=str(tmp_path / "teacher"))
    assert local_model(cfg) == str(tmp_path / "teacher")
    assert all(os.environ[name] == "1" for name in OFFLINE_ENV)
