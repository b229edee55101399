"""The automatic runtime hook: an unmodified DeepSpeed script joins the clusters' sync.

``install()`` runs at interpreter start in every worker process of a job whose spec keeps
``runtime: {auto: true}`` (the default): the plan puts ``runtime/autohook`` (a
``sitecustomize``) first on the worker's PYTHONPATH. It imports nothing heavy and changes
nothing until the script imports DeepSpeed or torch.distributed:

- ``deepspeed.initialize`` is replaced, as soon as ``deepspeed`` has been imported and before
  the script can bind it (``from deepspeed import initialize`` included), by a wrapper that
  returns DeepSpeed's own 4-tuple and attaches an ``EngineDriver`` (``runtime.engine``) to the
  first engine that has an optimizer. Engines without one (a reference or inference model)
  are left alone; a second engine with an optimizer is not synced (said once in the log).
- ``torch.distributed.destroy_process_group()`` (the default group) first finishes training:
  the last outer round and the final records, while the ranks can still talk.
- At exit (not after an uncaught exception) the driver finishes, if it has not yet; then the
  default process group the script left is destroyed (``settle.release_default_group``:
  otherwise a backend's or the store's thread can abort the process, exit 134, after training
  ended well); last of all the rank tells its agent that it ended (``config.parts.ENDED_ENV``),
  so that an abort in the interpreter's finalization after that is not restarted.
- In a world of two or more hosts, a rank leaves at once when another host's agent says that
  one of its ranks failed (``runtime.worldwatch``): nobody waits in a rendezvous or a
  collective for a rank that is gone.
- SIGTERM, when the script installs no handler of its own: the ranks agree on it at the next
  optimizer step, finish, and exit with status 0.
- A process that imported torch but never built a DeepSpeed engine says so once at exit, in
  its log and in a metric record (``no_deepspeed_engine``): nothing of it was synced.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from nebula_cli.config.parts import ENDED_ENV, SYNC_CONFIG_ENV
from nebula_cli.runtime import metrics, worldwatch


class _State:
    installed = False
    pid = 0  # the process that installed the hook (a forked child is not it)
    engines = 0  # engines deepspeed.initialize returned in this process
    driver: Any = None
    crashed = False
    said: set[str] = set()
    ended_file = ""  # $NEBULA_ENDED_FILE, taken from the environment (children do not inherit it)


_state = _State()


def say_once(key: str, message: str) -> None:
    if key not in _state.said:
        _state.said.add(key)
        print(f"nebula: {message}", file=sys.stderr, flush=True)


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after module ``name`` has been executed, before
    anything that imported it sees it (other finders find the module; its loader is kept)."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> Any:
        patch = self.patches.get(fullname)
        if patch is None or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def patch_deepspeed(module: ModuleType) -> None:
    """``deepspeed.initialize`` -> the wrapper that attaches the engine driver."""
    real = getattr(module, "initialize", None)
    if real is None or getattr(real, "_nebula_wrapped", False):
        return

    @functools.wraps(real)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        engine = result[0] if isinstance(result, tuple) and result else result
        on_engine(engine)
        return result

    initialize._nebula_wrapped = True  # type: ignore[attr-defined]
    module.initialize = initialize  # type: ignore[attr-defined]


def patch_torch_distributed(module: ModuleType) -> None:
    """``torch.distributed.destroy_process_group`` -> finish training first (default group);
    and the world's abort watch starts (``runtime.worldwatch``)."""
    worldwatch.start()
    real = getattr(module, "destroy_process_group", None)
    if real is None or getattr(real, "_nebula_wrapped", False):
        return

    @functools.wraps(real)
    def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        world = getattr(getattr(module, "group", None), "WORLD", None)
        if _state.driver is not None and (group is None or group is world):
            _finish("destroy_process_group")
        return real(group, *args, **kwargs)

    destroy_process_group._nebula_wrapped = True  # type: ignore[attr-defined]
    module.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "deepspeed": patch_deepspeed, "torch.distributed": patch_torch_distributed}


def install() -> None:
    """Patch on import (see the module's docstring); safe to call twice."""
    if _state.installed:
        return
    _state.installed = True
    _state.pid = os.getpid()
    _state.ended_file = os.environ.pop(ENDED_ENV, "")  # a child it starts is not the rank
    sys.meta_path.insert(0, PatchOnImport(PATCHES))
    for name, patch in PATCHES.items():
        if name in sys.modules:  # imported before the hook (not at interpreter start)
            patch(sys.modules[name])
    previous = sys.excepthook

    def excepthook(*exc: Any) -> None:
        _state.crashed = True  # no final round, nor a group destroyed, after an uncaught exception
        previous(*exc)

    sys.excepthook = excepthook
    atexit.register(_at_exit_say_ended)  # registered first: runs last
    atexit.register(_at_exit_release_group)
    atexit.register(_at_exit_without_engine)


def on_engine(engine: Any) -> None:
    """Attach the driver to the first engine that has an optimizer."""
    from nebula_cli.runtime.engine import EngineDriver

    _state.engines += 1
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or type(optimizer).__name__ == "DummyOptim":
        say_once("no-optimizer", "a DeepSpeed engine without an optimizer (a reference or "
                 "inference model) is not synced")
        return
    if _state.driver is not None:
        say_once("second", "a second DeepSpeed engine with an optimizer: only the first one "
                 "is synced across clusters")
        return
    if type(engine).__name__ == "PipelineEngine":
        say_once("pipeline", "a DeepSpeed PipelineEngine (train_batch) is not driven by the "
                 "automatic hook")
        return
    _state.driver = EngineDriver(engine, watch_stop=_watch_sigterm())
    atexit.register(_at_exit_with_engine)  # after the script's imports: runs before theirs


def _watch_sigterm() -> bool:
    """Own SIGTERM when the script left it at the default (from the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False

    def on_term(signum: int, frame: object) -> None:
        if _state.driver is not None:
            _state.driver.stop_requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process

    signal.signal(signal.SIGTERM, on_term)
    return True


def finish_training(reason: str) -> None:
    """End the synced training now (the last outer round and the final records), if an engine
    is driven and has not finished: for code that knows training is over (a Trainer's
    on_train_end) before the process exits."""
    _finish(reason)


def _finish(reason: str) -> None:
    driver = _state.driver
    if driver is None or driver.finished:
        return
    try:
        driver.finish(reason)
    except Exception as exc:  # the script's own exit must go on
        driver.finished = True
        print(f"nebula: finishing training failed: {exc!r}", file=sys.stderr, flush=True)


def register_exit_again() -> None:
    """Register this hook's exit handlers again, so that they run before every handler
    registered so far (atexit runs the latest first): a metrics sink opened since, which
    closes at exit (W&B finishes its run), still gets the end of training's records."""
    if _state.installed:
        atexit.unregister(_at_exit_without_engine)
        atexit.register(_at_exit_without_engine)
    if _state.driver is not None:
        atexit.unregister(_at_exit_with_engine)
        atexit.register(_at_exit_with_engine)


def _at_exit_with_engine() -> None:
    if not _state.crashed:
        _finish("exit")


def _at_exit_release_group() -> None:
    """Destroy the default process group the script left (see ``runtime.settle``), in the
    process that installed the hook, unless it crashed (its peers may be mid-collective)."""
    if _state.crashed or os.getpid() != _state.pid or "torch.distributed" not in sys.modules:
        return
    try:
        from nebula_cli.runtime import settle

        settle.release_default_group()
    except Exception as exc:  # the exit goes on
        print(f"nebula: destroying the process group at exit failed: {exc!r}", file=sys.stderr,
              flush=True)


def _at_exit_say_ended() -> None:
    """The last exit handler: the script returned without an uncaught exception and every exit
    handler ran, so its agent is told (``$NEBULA_ENDED_FILE`` created) that what is left is the
    interpreter's finalization: an abort there (exit 134) is not a rank to restart."""
    path = _state.ended_file
    if _state.crashed or os.getpid() != _state.pid or not path:
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    except OSError as exc:  # the exit goes on; an abort after it is then restarted
        print(f"nebula: cannot mark the end at {path}: {exc}", file=sys.stderr, flush=True)


def _at_exit_without_engine() -> None:
    """Say once that this process trained with no DeepSpeed engine (nothing synced)."""
    if _state.engines or not _says_for_this_process():
        return
    relay = bool(os.environ.get(SYNC_CONFIG_ENV))
    what = ("no cross-cluster sync happened (the relay was not used by this process)"
            if relay else "nebula recorded no training metrics for it")
    print(f"nebula: no DeepSpeed engine was seen (deepspeed.initialize was never called): "
          f"{what}", file=sys.stderr, flush=True)
    calls, step = metrics.script_logged()
    metrics.emit(step=step if calls else 0, no_deepspeed_engine=True,
                 cross_cluster_sync=False)


def _says_for_this_process() -> bool:
    """A training process (it imported torch), rank 0 of its cluster (nebula sets RANK for
    every rank it starts), and not a helper: a multiprocessing child, DeepSpeed's own
    launcher, or a process with no rank of its own."""
    if "torch" not in sys.modules or os.environ.get("RANK") != "0":
        return False
    mp = sys.modules.get("multiprocessing")
    if mp is not None and mp.parent_process() is not None:
        return False
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return not (main_spec and str(main_spec.name).startswith("deepspeed.launcher"))
