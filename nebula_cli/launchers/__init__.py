"""The scripts that run on each host, shipped inside the package beside this module (package
data, read with `importlib.resources`, so a wheel install has them as a source tree does): fed
to hosts on stdin, nothing copied before they run (`bootstrap.sh`), and the schedulers' batch
templates, each in its scheduler's package (`nebula_cli/schedulers/slurm/slurm.sbatch`, read
through `launcher(name, package)`). The repository's `launchers/` is a link to this folder."""

from __future__ import annotations

from importlib import resources

from nebula_cli.errors import NebulaError

LAUNCHERS = resources.files(__name__)
"""This folder, as the installed package has it."""


def launcher(name: str, package: str = __name__) -> bytes:
    """The bytes of the packaged launcher `name` (e.g. ``bootstrap.sh``) in `package` (this
    folder, or a scheduler's package for its batch template)."""
    folder = resources.files(package)
    path = folder / name
    try:
        return path.read_bytes()
    except OSError as exc:
        raise NebulaError(f"nebula's launcher {name} is missing from {folder} "
                          f"({exc.strerror}): the installation is incomplete; reinstall "
                          "nebula-cli (`pipx reinstall nebula-cli` or `pip install "
                          "--force-reinstall nebula-cli`)") from exc
