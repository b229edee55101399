"""Every scheduler nebula knows, registered once: a package each, named in `PACKAGES`.

A scheduler's package holds one module per layer it serves, found by its name (nothing else
lists them): `scheduler` (required: `SCHEDULER`, a `config.schedulers.base.Scheduler`, whose
`name` is what a cluster's `scheduler:` says, and whose `section_model` (its `spec` module)
becomes the cluster's section of that name), `allocator` (`ALLOCATOR`, a
`scheduler.base.Allocator`, for a scheduler whose hosts come from an allocation), `node_conn`
(`CONN`, the transport kind of its nodes). Each layer's registry takes its part of every
package from here (`config/schedulers/registry.py`, `scheduler/registry.py`,
`transport/registry.py`); the spec's names, sections and the stored kinds derive from it.
Standard library only, and nothing is imported until a layer asks for its part.
"""

from __future__ import annotations

import importlib
from importlib.util import find_spec
from types import ModuleType

PACKAGES = ["nebula_cli.schedulers.none", "nebula_cli.schedulers.slurm"]
"""The schedulers' packages, in the order the spec lists their names."""


def parts(module: str, *, required: bool = False) -> list[ModuleType]:
    """Every registered scheduler's module `module` (`scheduler`, `allocator`, `node_conn`),
    in `PACKAGES`' order; a package without one is left out, or refused if `required`."""
    found = []
    for package in PACKAGES:
        name = f"{package}.{module}"
        if find_spec(name) is None:
            if required:
                raise ImportError(f"scheduler package {package} has no {module} module "
                                  f"(nebula_cli/schedulers/registry.py: every package needs "
                                  f"one)", name=name)
            continue
        found.append(importlib.import_module(name))
    return found
