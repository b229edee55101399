"""The starter specs `nebula init` writes, shipped inside the package (package data read with
`importlib.resources`, present in a wheel install): `ssh.yaml` (two SSH clusters joined by
their relays, the fields to edit commented) and `local.yaml` (runs on this machine as it is;
the repository's `templates/hello.yaml` links to it)."""

from __future__ import annotations

from importlib import resources

from nebula_cli.errors import NebulaError, UsageError

TEMPLATES = resources.files(__name__)
"""This folder, as the installed package has it."""
DEFAULT_TEMPLATE = "ssh"


def template_names() -> list[str]:
    """The starters by name (their file names without `.yaml`), sorted."""
    return sorted(p.name.removesuffix(".yaml") for p in TEMPLATES.iterdir()
                  if p.name.endswith(".yaml"))


def template_text(name: str) -> str:
    """The text of the starter `name`; UsageError naming the choices for an unknown one."""
    if name not in template_names():
        raise UsageError(f"no starter spec named {name!r}; choose one of "
                         f"{', '.join(template_names())}")
    try:
        return (TEMPLATES / f"{name}.yaml").read_text()
    except OSError as exc:
        raise NebulaError(f"nebula's starter {name}.yaml cannot be read from {TEMPLATES} "
                          f"({exc.strerror}): reinstall nebula-cli") from exc
