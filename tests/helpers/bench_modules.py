"""The bench's scripts and helpers (bench/*.py: not a package) loaded as modules for tests:
`load_bench(name)`, with bench/ put on sys.path once (they import each other by name)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from helpers.jobs import REPO

BENCH = REPO / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py, executed afresh as module `bench_<name>` (registered in sys.modules:
    dataclasses look their module up there)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
