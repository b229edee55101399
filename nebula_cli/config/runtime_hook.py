"""Where the automatic runtime hook is on a host, and a process environment with it first on
PYTHONPATH, or (the setup command: not a training process) without it."""

from __future__ import annotations

import posixpath
from pathlib import Path

from nebula_cli.config.plan_model import RUNTIME_HOOK_DIR, Site, lib_dir


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


def without_runtime_hook(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process that is not a training process (the setup command): the hook's
    directory left off PYTHONPATH."""
    hook = posixpath.join(*RUNTIME_HOOK_DIR)
    parts = [p for p in env.get("PYTHONPATH", "").split(":") if p and not p.endswith(hook)]
    out = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    if parts:
        out["PYTHONPATH"] = ":".join(parts)
    return out
