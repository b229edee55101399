"""`nebula init` (cli/app.py, templates/): writes a packaged starter spec that validates as it
is, never over an existing file unless told (nor through a symlink, dangling or not), mode 0600
whatever the umask, and names the starters when asked for another."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nebula_cli.cli.app import app
from nebula_cli.config.spec import load_spec
from nebula_cli.templates import template_names


@pytest.mark.parametrize("name", template_names())
def test_each_starter_is_written_and_validates(name: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    made = CliRunner().invoke(app, ["init", "-t", name, "mine.yaml"])
    assert made.exit_code == 0, made.output
    assert f"wrote mine.yaml (starter: {name})" in made.output
    spec = load_spec(tmp_path / "mine.yaml")
    assert len(spec.clusters) == 2 and Path(spec.workdir) == tmp_path.resolve()


def test_an_existing_file_is_kept_unless_forced(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text("mine\n")
    refused = CliRunner().invoke(app, ["init"])
    assert refused.exit_code == 2 and "--force" in refused.output
    assert (tmp_path / "job.yaml").read_text() == "mine\n"
    forced = CliRunner().invoke(app, ["init", "--force"])
    assert forced.exit_code == 0 and "ssh" in (tmp_path / "job.yaml").read_text()
    unknown = CliRunner().invoke(app, ["init", "-t", "k8s", "other.yaml"])
    assert unknown.exit_code == 2 and "local, ssh" in unknown.output
    assert not (tmp_path / "other.yaml").exists()


def _init(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`nebula init` in a real process with the usual umask (022)."""
    return subprocess.run([sys.executable, "-m", "nebula_cli", "init", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, umask=0o022,
                          stdin=subprocess.DEVNULL, env={**os.environ, "NO_COLOR": "1"})


def test_the_spec_is_private_and_never_written_through_a_symlink(tmp_path: Path) -> None:
    made = _init(tmp_path, "mine.yaml")
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(os.lstat(tmp_path / "mine.yaml").st_mode) == 0o600  # not 0644
    elsewhere = tmp_path / "elsewhere" / "planted.yaml"
    elsewhere.parent.mkdir()
    (tmp_path / "job.yaml").symlink_to(elsewhere)  # dangling: exists() says no
    refused = _init(tmp_path)
    assert refused.returncode == 2 and "job.yaml exists" in refused.stdout + refused.stderr
    assert not elsewhere.exists()
    forced = _init(tmp_path, "--force")  # replaces the link itself
    assert forced.returncode == 0, forced.stderr
    assert not elsewhere.exists() and not (tmp_path / "job.yaml").is_symlink()
    assert stat.S_IMODE(os.lstat(tmp_path / "job.yaml").st_mode) == 0o600
    assert "clusters:" in (tmp_path / "job.yaml").read_text()
