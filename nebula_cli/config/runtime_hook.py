"""Where the automatic runtime hook is on a host, and a process environment with it first on
PYTHONPATH (a process that is not a rank runs with `config.parts.helper_env`)."""

from __future__ import annotations

import posixpath
from pathlib import Path

from nebula_cli.config.parts import RUNTIME_HOOK_DIR
from nebula_cli.config.plan_model import Site, lib_dir


def runtime_hook_dir(site: Site, job_root: str) -> str:
    """Where the automatic hook's sitecustomize is on the host: in the package this machine
    runs (a host that shares our files), else in the uploaded copy under the job's lib."""
    if site.shares_files:
        return str(Path(__file__).resolve().parent.parent.joinpath(*RUNTIME_HOOK_DIR))
    return posixpath.join(lib_dir(job_root), "nebula_cli", *RUNTIME_HOOK_DIR)


def with_runtime_hook(env: dict[str, str], site: Site, job_root: str) -> dict[str, str]:
    """`env` with the automatic hook's directory first on PYTHONPATH (what was there kept)."""
    parts = [runtime_hook_dir(site, job_root)]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    return {**env, "PYTHONPATH": ":".join(parts)}

