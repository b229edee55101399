"""Python versions on the hosts: `validate --hosts` and `require_python` refuse an interpreter
older than 3.11 by host, version and fix. The old interpreter is a real Python started through a
wrapper whose sitecustomize makes it report 3.10.12, so the probes run for real."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.jobs import CLI, write_spec

from nebula_cli.control.hostcheck import MIN_PYTHON, check_host, require_python, too_old
from nebula_cli.errors import TransportError
from nebula_cli.transport.local.transport import LocalTransport

OLD = "3.10.12"
NEED = ".".join(map(str, MIN_PYTHON))


def fake_python(directory: Path, version: str = OLD) -> Path:
    """An interpreter that says it is Python `version` (sys.version_info and platform agree)."""
    site = directory / "fake-site"
    site.mkdir(parents=True, exist_ok=True)
    major, minor, micro = (int(x) for x in version.split("."))
    (site / "sitecustomize.py").write_text(
        "import platform, sys\n"
        f"sys.version_info = ({major}, {minor}, {micro}, 'final', 0)\n"
        f"platform.python_version = lambda: {version!r}\n")
    script = directory / "python-old"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    return script


def test_the_fake_interpreter_really_reports_the_old_version(tmp_path: Path) -> None:
    t = LocalTransport("old-host", home=str(tmp_path / "home"), python=str(fake_python(tmp_path)))
    result = t.run([t.python, "-c", "import sys; print(sys.version_info[:2])"])
    assert result.stdout.strip() == "(3, 10)"


def test_require_python_refuses_an_old_interpreter(tmp_path: Path) -> None:
    python = fake_python(tmp_path)
    t = LocalTransport("gpu-7", home=str(tmp_path / "home"), python=str(python))
    with pytest.raises(TransportError) as info:
        require_python(t, "east", "gpu-7")
    message = str(info.value)
    assert info.value.host == "east/gpu-7" and message.startswith("east/gpu-7: ")
    assert OLD in message and f"python{NEED}" in message and str(python) in message
    assert "`python:`" in message


def test_require_python_accepts_this_interpreter(tmp_path: Path) -> None:
    t = LocalTransport("h", home=str(tmp_path / "home"), python=sys.executable)
    assert require_python(t, "east", "h") is None
    newer = LocalTransport("h", home=str(tmp_path / "home"),
                           python=str(fake_python(tmp_path / "new", "3.13.1")))
    assert require_python(newer, "east", "h") is None


def test_require_python_names_a_missing_or_broken_interpreter(tmp_path: Path) -> None:
    missing = LocalTransport("h", home=str(tmp_path), python=str(tmp_path / "no-python"))
    with pytest.raises(TransportError) as info:
        require_python(missing, "west", "h")
    assert info.value.host == "west/h" and "no-python" in str(info.value)
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'not a version'\n")
    broken.chmod(0o755)
    with pytest.raises(TransportError) as info:
        require_python(LocalTransport("h", home=str(tmp_path), python=str(broken)), "west", "h")
    assert "cannot tell the version" in str(info.value)


def test_check_host_reports_an_old_interpreter_as_a_problem(tmp_path: Path) -> None:
    python = fake_python(tmp_path)
    t = LocalTransport("gpu-7", home=str(tmp_path / "home"), python=str(python))
    check = check_host(t, "east", "gpu-7", 1)
    assert check.reachable and check.python == OLD and not check.ok
    (problem,) = [p for p in check.problems if OLD in p]
    assert f"python{NEED}" in problem and str(python) in problem
    fine = check_host(LocalTransport("h", home=str(tmp_path / "home")), "east", "h", 1)
    assert not [p for p in fine.problems if "Python" in p]


@pytest.mark.parametrize(("version", "ok"), [("3.11.0", True), ("3.12.4", True),
                                             ("3.10.12", False), ("2.7.18", False),
                                             ("", False), ("3", False)])
def test_too_old(version: str, ok: bool) -> None:
    assert (too_old(version) is None) is ok


def test_validate_hosts_names_the_host_with_an_old_python(tmp_path: Path, cli: CLI) -> None:
    python = fake_python(tmp_path)
    spec = write_spec(tmp_path, f"""
name: old
run: echo hi
clusters:
  - name: east
    transport: local
    python: {python}
    hosts: [gpu-7]
""")
    proc = cli("validate", str(spec), "--hosts", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "east/gpu-7" in proc.stderr and OLD in proc.stderr and f"python{NEED}" in proc.stderr
    assert "Traceback" not in proc.stderr
