"""nebula installed from a wheel, as `pipx install nebula-cli` leaves it: its own venv, no
source tree near it, run from an empty directory (REALWORLD.md, Installation: "installed from
a wheel into its own venv ... run from an unrelated directory"), launching local and SSH
jobs.

The wheel is built from a copy of this checkout (its package, pyproject.toml, README) and
installed without its dependencies into a fresh
venv that sees this venv's site-packages through a plain path (`.pth` line; this venv's own
`.pth` files, the editable install's finder among them, are not run there): so `nebula_cli`
comes from the wheel alone, and what the package reads at run time (the launchers, the
starter specs) must be in it. Nothing needs the network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.jobs import REMOTE_JOBS, REPO, kill_job_processes, wait_for
from helpers.local_sshd import SSHD, local_sshd

pytestmark = pytest.mark.slow


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 120,
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _cmdlines() -> list[list[str]]:
    """Every process's argv."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            found.append(entry.joinpath("cmdline").read_bytes().decode().split("\0"))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin/ folder of a fresh venv holding nebula installed from a wheel of this tree."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: the build leaves its build/ there, not in the checkout
    shutil.copytree(REPO / "nebula_cli", source / "nebula_cli",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(root / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    wheels = list((root / "dist").glob("nebula_cli-*.whl"))
    assert len(wheels) == 1, wheels
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheels[0])],
                   check=True, capture_output=True, timeout=300)
    return venv / "bin"


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """An empty directory far from the checkout, and an environment with its own NEBULA_HOME
    (jobs it started are ended after)."""
    work = tmp_path / "empty"
    work.mkdir()
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(NEBULA_HOME=str(home), COLUMNS="200", NO_COLOR="1")
    yield work, env
    for job in (home / "jobs").glob("*") if (home / "jobs").exists() else []:
        kill_job_processes(job.name)


def test_wheel_has_what_the_package_reads(installed: Path,
                                          elsewhere: tuple[Path, dict[str, str]]) -> None:
    """The installed package is the wheel's (not this tree), and it reads its launchers and
    starters from itself."""
    work, env = elsewhere
    probe = _run([str(installed / "python"), "-c",
                  "import nebula_cli, nebula_cli.launchers as l, nebula_cli.templates as t;"
                  "print(nebula_cli.__file__);"
                  "print(len(l.launcher('bootstrap.sh')),"
                  " len(l.launcher('slurm.sbatch', 'nebula_cli.schedulers.slurm')));"
                  "print(*t.template_names())"], work, env)
    assert probe.returncode == 0, probe.stderr
    where, sizes, names = probe.stdout.splitlines()
    assert Path(where).is_relative_to(installed.parent), where
    assert not Path(where).is_relative_to(REPO)
    assert all(int(n) > 100 for n in sizes.split())
    assert names.split() == ["local", "ssh"]
    version = _run([str(installed / "nebula"), "--version"], work, env)
    assert version.returncode == 0 and version.stdout.startswith("nebula "), version
    helped = _run([str(installed / "nebula"), "--help"], work, env)
    assert helped.returncode == 0 and "init" in helped.stdout and "launch" in helped.stdout


def test_init_validate_launch_from_an_empty_directory(
        installed: Path, elsewhere: tuple[Path, dict[str, str]]) -> None:
    """`nebula init` writes starters that validate; the local one launches, reports its
    status and logs, and stops, all from the wheel's install."""
    work, env = elsewhere
    nebula = str(installed / "nebula")
    made = _run([nebula, "init"], work, env)
    assert made.returncode == 0, made.stderr
    assert (work / "job.yaml").read_text().startswith("# A nebula job")
    checked = _run([nebula, "validate", "job.yaml"], work, env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "2 clusters" in checked.stdout
    example = _run([nebula, "validate", str(REPO / "examples" / "ds_plain" / "nebula.yaml")],
                   work, env)
    assert example.returncode == 0, example.stdout + example.stderr

    assert _run([nebula, "init", "-t", "local", "hello.yaml"], work, env).returncode == 0
    launched = _run([nebula, "launch", "hello.yaml", "--detach"], work, env)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    job_id = launched.stdout.strip().splitlines()[0]
    wait_for(lambda: "step 2 on west/w2" in _run([nebula, "logs", job_id], work, env).stdout,
             timeout=60)
    status = _run([nebula, "status", job_id], work, env)
    assert status.returncode == 0 and "RUNNING" in status.stdout, status.stdout
    agents = [argv[0] for argv in _cmdlines() if "nebula_cli.agent" in argv
              and any(job_id in arg for arg in argv)]
    assert len(agents) == 4 and set(agents) == {str(installed / "python")}, agents
    stopped = _run([nebula, "stop", job_id], work, env)
    assert stopped.returncode == 0 and f"{job_id} stopped" in stopped.stdout, stopped.stdout


def test_a_two_cluster_job_with_relays_from_the_wheel_install(
        installed: Path, elsewhere: tuple[Path, dict[str, str]]) -> None:
    """An unmodified DeepSpeed script (examples/ds_plain, copied into the empty directory)
    trained by two clusters joined by their relays, all from the wheel's install: the relays'
    rounds happen, and both clusters end with the same parameters."""
    work, env = elsewhere
    for name in ("train.py", "ds_config.json"):
        shutil.copy(REPO / "examples" / "ds_plain" / name, work / name)
    (work / "job.yaml").write_text(
        "name: wheel-relays\nworkdir: .\nrun: python -u train.py --steps 7\n"
        "env: {OMP_NUM_THREADS: 1}\nclusters:\n"
        "  - {name: east, transport: local, hosts: [e1]}\n"
        "  - {name: west, transport: local, hosts: [w1]}\n"
        "relay:\n  sync: {mode: diloco, inner_steps: 3}\n  compression: {codec: int8}\n"
        "  timeout: 60\n")
    env["PATH"] = f"{installed}:{env['PATH']}"  # `python` in run: is the install's, as pipx's
    launched = _run([str(installed / "nebula"), "launch", "job.yaml"], work, env, timeout=400)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    (job_dir,) = (Path(env["NEBULA_HOME"]) / "jobs").iterdir()
    status = _run([str(installed / "nebula"), "status", job_dir.name, "--json"], work, env)
    assert json.loads(status.stdout)["state"] == "SUCCEEDED", status.stdout
    records = [json.loads(line) for f in job_dir.glob("*/*/worker/metrics/*.jsonl")
               for line in f.read_text().splitlines() if line]
    finals = [r for r in records if r.get("final")]
    assert len(finals) == 2 and len({r["param_sha256"] for r in finals}) == 1, finals
    assert sum(1 for r in records if "round_s" in r) >= 4, records  # 3 rounds + the last


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SSHD) or shutil.which("ssh") is None,
                    reason="needs root, openssh-server and OpenSSH's client")
def test_an_ssh_job_from_the_wheel_install(installed: Path, tmp_path: Path,
                                           elsewhere: tuple[Path, dict[str, str]]) -> None:
    """The installed nebula launches on an SSH host (a real sshd on 127.0.0.1, an alias of
    the user's ssh_config): what it uploads is the installed package, package data included."""
    work, env = elsewhere
    nebula = str(installed / "nebula")
    (tmp_path / "sshd").mkdir()
    with local_sshd(tmp_path / "sshd", sftp=True) as server:
        config = tmp_path / "ssh_config"
        config.write_text(f"Host gpu-a\n  HostName 127.0.0.1\n  Port {server.port}\n"
                          f"  User root\n  IdentityFile {server.user_key}\n")
        env.update(NEBULA_SSH_CONFIG=str(config), NEBULA_KNOWN_HOSTS=str(server.known_hosts))
        (work / "job.yaml").write_text(
            "name: wheel-ssh\nrun: for i in $(seq 1 30); do echo \"tick $i\"; sleep 1; done\n"
            f"clusters:\n  - name: far\n    python: {sys.executable}\n    hosts: [gpu-a]\n"
            "  - name: near\n    transport: local\n    hosts: [n1]\n")
        launched = _run([nebula, "launch", "job.yaml", "--detach"], work, env, timeout=180)
        assert launched.returncode == 0, launched.stdout + launched.stderr
        job_id = launched.stdout.strip().splitlines()[0]
        try:
            wait_for(lambda: "far/gpu-a/0 | tick 2" in _run([nebula, "logs", job_id], work,
                                                            env).stdout, timeout=60)
            lib = REMOTE_JOBS / job_id / "lib" / "nebula_cli"
            assert (lib / "launchers" / "bootstrap.sh").read_bytes() == (
                installed.parent / _purelib_rel(installed) / "nebula_cli" / "launchers"
                / "bootstrap.sh").read_bytes()
            assert (lib / "templates" / "ssh.yaml").exists()
            stopped = _run([nebula, "stop", job_id], work, env)
            assert stopped.returncode == 0 and f"{job_id} stopped" in stopped.stdout, stopped
        finally:
            shutil.rmtree(REMOTE_JOBS / job_id, ignore_errors=True)


def _purelib_rel(bin_dir: Path) -> str:
    """The venv's site-packages, relative to the venv."""
    return subprocess.run([str(bin_dir / "python"), "-c",
                           "import sysconfig, sys; print(sysconfig.get_paths()['purelib']"
                           ".removeprefix(sys.prefix + '/'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
