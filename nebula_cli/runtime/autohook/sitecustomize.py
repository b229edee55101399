"""nebula's automatic runtime hook, first on a worker's PYTHONPATH (spec: runtime.auto, on by
default): installs ``nebula_cli.runtime.hook`` at interpreter start, then runs the
``sitecustomize`` this one shadows (the next one on sys.path), as Python would have.

This directory holds nothing else, so that putting it on PYTHONPATH adds no other module.
A hook that cannot be installed is said in the log; it never stops the interpreter.
"""

import os
import sys


def _install(here: str) -> None:
    try:
        try:
            from nebula_cli.runtime import hook
        except ImportError:  # nebula_cli not installed where this python looks: use ours
            sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(here))))
            from nebula_cli.runtime import hook
        hook.install()
    except Exception as exc:
        print(f"nebula: the automatic runtime hook is not active ({exc!r}): this process "
              "will not sync across clusters", file=sys.stderr, flush=True)


def _chain(here: str) -> None:
    """Run the sitecustomize this one shadows, under its own name."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_here = os.path.dirname(os.path.abspath(__file__))
_install(_here)
_chain(_here)
