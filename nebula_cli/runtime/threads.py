"""Background work that must happen even where no thread can be started: the hook's end runs
in atexit, where Python 3.12 may refuse new threads (RuntimeError)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def start_or_run(target: Callable[..., Any], args: tuple[Any, ...],
                 name: str) -> threading.Thread | None:
    """``target(*args)`` in a daemon thread (returned), or here and now when the interpreter
    refuses a new thread (None)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no new thread at interpreter shutdown
        target(*args)
        return None
    return thread
