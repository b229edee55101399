"""The scripts in the repository's `launchers/` (what runs on each host), read by the control
plane and fed to hosts on stdin: nothing has to be copied before they run (`bootstrap.sh`),
and the schedulers' batch templates (`slurm.sbatch`)."""

from __future__ import annotations

from pathlib import Path

from nebula_cli.errors import NebulaError

LAUNCHERS_DIR = Path(__file__).resolve().parents[1] / "launchers"


def launcher(name: str) -> bytes:
    """The bytes of `launchers/<name>`."""
    path = LAUNCHERS_DIR / name
    try:
        return path.read_bytes()
    except OSError as exc:
        raise NebulaError(f"{path} is missing ({exc.strerror}): nebula runs from its source "
                          "tree, installed with `pip install -e .` (see the README)") from exc
