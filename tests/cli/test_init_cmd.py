"""`nebula init` (cli/app.py, templates/): writes a packaged starter spec that validates as it
is, never over an existing file unless told, and names the starters when asked for another."""

from __future__ import annotations

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
