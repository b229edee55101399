"""The engine driver of the automatic hook: what nebula does with a DeepSpeed engine that an
unmodified training script built (``runtime.hook`` attaches it inside ``deepspeed.initialize``).

The engine stays the object DeepSpeed returned (same type, so ``isinstance(engine,
DeepSpeedEngine)`` holds); only its ``backward`` and ``step`` are wrapped, as instance
attributes that forward every argument to the real methods:

- ``backward(loss, ...)`` records the loss, and in gradient mode averages the gradients across
  clusters at each accumulation boundary (``OuterSync.after_backward``);
- ``step(...)`` counts optimizer steps (``engine.global_steps`` moves only at a
  gradient-accumulation boundary) and after each one runs ``OuterSync.after_step``: an outer
  round every ``inner_steps``.

The OuterSync is built at the first ``forward``, ``backward`` or ``step`` (the parameters are
still the initial ones, the same on every cluster), only when the job has a relay (or in
`nebula plan`'s dry run). A script that builds its own OuterSync on the engine keeps it: the
driver then stands aside (no sync, no records, no checkpoints). Rank 0 of the cluster records
loss (averaged over the cluster's ranks), steps_per_s, samples_per_s and lr every ``LOG_EVERY``
optimizer steps, at step 1 and after every round, unless the script records metrics itself
(``runtime.log``).

Checkpoints (the spec's ``checkpoint:``, see ``runtime.checkpoint``): at that first call the
newest checkpoint every rank of the cluster has is loaded (DeepSpeed's states, then the outer
state), before anything is trained; one is saved every ``checkpoint.every`` optimizer steps and
at the end. An unmodified script restarted after a failure runs its loop from its first step
again: the driver fast-forwards it. The first N optimizer steps of the run (N: the checkpoint's
step) are replayed without training (``forward`` under ``torch.no_grad``, no ``backward``, no
``step``; ``engine.global_steps`` stays at N), so the script's loop, data order and step count
continue where the checkpoint left off and ``--steps`` is not exceeded. A script whose loop
counts ``engine.global_steps`` itself is replayed too (wasted forward passes, the same result).

``finish(reason)`` ends training on every rank: the last outer round (``OuterSync.finish``),
the final checkpoint, then a ``final`` record with a sha256 of the parameters on every rank. A
SIGTERM seen by any rank (when the hook owns the handler) is agreed on at the next optimizer
step; every rank then finishes and leaves with exit status 0.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from nebula_cli.errors import NebulaError
from nebula_cli.runtime import metrics, settings
from nebula_cli.runtime.explicit import outer_sync_of
from nebula_cli.runtime.params import zero_stage
from nebula_cli.runtime.settle import keep, settle

LOG_EVERY = 10
"""Optimizer steps between the hook's metric records (step 1 and rounds are always recorded)."""


def say(message: str) -> None:
    """One line in the worker's log, marked as nebula's."""
    print(f"nebula: {message}", file=sys.stderr, flush=True)


def param_checksum(engine: Any) -> str | None:
    """sha256 of every parameter's fp32 values in name order (a collective under ZeRO, so on
    every rank); None when ZeRO's process group is already gone."""
    zero = zero_stage(engine) > 0
    if zero and not (dist.is_available() and dist.is_initialized()):
        return None
    get_full = None
    if zero:
        from deepspeed.utils import safe_get_full_fp32_param as get_full
    h = hashlib.sha256()
    module = getattr(engine, "module", engine)
    for _, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        full = get_full(p) if get_full is not None else p.data
        h.update(full.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class EngineDriver:
    """Wraps one engine's ``backward`` and ``step`` (see the module's docstring)."""

    def __init__(self, engine: Any, *, watch_stop: bool) -> None:
        self.engine = engine
        self.watch_stop = watch_stop
        """The hook owns SIGTERM: the ranks agree on a stop request at every optimizer step."""
        self.stop_requested = False
        self.sync: Any = None
        self.started = False
        self.aside: str | None = None
        self.finished = False
        self.steps = 0
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self._loss = torch.zeros((), dtype=torch.float64)
        self._micro = 0
        self._window = [0.0, 0.0]  # the cluster's loss sum and count since the last record
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._mark: tuple[float, int] | None = None  # (time, step) of the last record
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        self._group = None
        if self.world_size > 1 and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # CPU values beside NCCL
        self.checkpointer: Any = None
        self.resumed_from: int | None = None
        self.replay_left = 0  # optimizer steps of the script still to fast-forward
        self._replay_micro = 0
        self._first_step = 0
        self._real_forward = getattr(engine, "forward", None)
        self._real_backward = engine.backward
        self._real_step = engine.step
        if callable(self._real_forward):
            engine.forward = functools.update_wrapper(self._forward_wrapper(),
                                                      self._real_forward)
        engine.backward = functools.update_wrapper(self._backward_wrapper(), self._real_backward)
        engine.step = functools.update_wrapper(self._step_wrapper(), self._real_step)

    # --- the wrapped methods ----------------------------------------------------------------

    def _forward_wrapper(self) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self.forward(*args, **kwargs)
        return forward

    def _backward_wrapper(self) -> Any:
        def backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
            return self.backward(loss, *args, **kwargs)
        return backward

    def _step_wrapper(self) -> Any:
        def step(*args: Any, **kwargs: Any) -> Any:
            return self.step(*args, **kwargs)
        return step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.started:
            self._start()
        if self.replay_left:
            with torch.no_grad():
                return self._real_forward(*args, **kwargs)
        return self._real_forward(*args, **kwargs)

    def backward(self, loss: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.started:
            self._start()
        if self.replay_left:
            return None
        out = self._real_backward(loss, *args, **kwargs)
        if self.aside is None and not self.finished:
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                self._loss = self._loss + loss.detach().to("cpu", torch.float64).reshape(())
                self._micro += 1
            if self.sync is not None:
                self.sync.after_backward()  # gradient mode; a no-op in DiLoCo mode
        return out

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.started:
            self._start()
        if self.replay_left:
            self._replayed()
            return None
        before = getattr(self.engine, "global_steps", None)
        out = self._real_step(*args, **kwargs)
        after = getattr(self.engine, "global_steps", None)
        if not isinstance(after, int):
            after = self.steps + 1
        if after != before:
            self._optimizer_step(after)
        return out

    # --- what happens around them -----------------------------------------------------------

    def _start(self) -> None:
        self.started = True
        if self._explicit():
            self._stand_aside()
        elif settings.wanted():
            from nebula_cli.runtime.sync import OuterSync

            self.sync = OuterSync(self.engine)
            if self.sync.config is not None and self.sync.config.checkpoint is not None:
                self._resume(self.sync.config.checkpoint)

    def _resume(self, checkpoint: Any) -> None:
        """Load the newest checkpoint of the cluster, if any, and fast-forward the script."""
        from nebula_cli.runtime.checkpoint import Checkpointer

        self.checkpointer = Checkpointer(self.engine, checkpoint, sync=self.sync,
                                         group=self._group)
        step = self.checkpointer.load_newest()
        if step:
            self.resumed_from = self.replay_left = self.steps = self._first_step = step

    def _replayed(self) -> None:
        """One `step` call of the script fast-forwarded (see the module's docstring)."""
        self._replay_micro += 1
        accum = getattr(self.engine, "gradient_accumulation_steps", None)
        if self._replay_micro >= (int(accum()) if callable(accum) else 1):
            self._replay_micro = 0
            self.replay_left -= 1
            if not self.replay_left and self.rank == 0:
                say(f"fast-forwarded the script to optimizer step {self.resumed_from}; "
                    "training goes on from there")

    def _explicit(self) -> bool:
        """The script built an OuterSync of its own on this engine."""
        return outer_sync_of(self.engine) not in (None, self.sync)

    def _stand_aside(self) -> None:
        self.aside = "the script syncs this engine with its own OuterSync"
        if self.sync is not None:
            self.sync.close()
            self.sync = None
            say("the script built its own OuterSync after training began; the automatic "
                "hook stops syncing (set runtime: {auto: false} for explicit-API scripts)")
        if self.rank == 0:
            say(f"automatic hook stands aside: {self.aside}")

    def _optimizer_step(self, steps: int) -> None:
        self.steps = steps
        now = time.perf_counter()
        self._t_last = now
        if self._t_first is None:
            self._t_first = now
        if self.finished or self.aside is not None:
            return
        if self._explicit():
            self._stand_aside()
            return
        stats = self.sync.after_step(steps) if self.sync is not None else None
        if self.checkpointer is not None and self.checkpointer.due(steps):
            self.checkpointer.save(steps)
        due = stats is not None or steps == 1 or steps % LOG_EVERY == 0
        if not (due or self.watch_stop):
            return
        stop = self._agree()
        if due:
            self._record(steps, now, stats)
        if stop:
            if self.rank == 0:
                say(f"SIGTERM: stopping after optimizer step {steps}")
            self.finish("SIGTERM")
            raise SystemExit(0)

    def _agree(self) -> bool:
        """One small all-reduce over the cluster's ranks: any stop request, the loss so far."""
        t = torch.tensor([float(self.stop_requested), float(self._loss), float(self._micro)],
                         dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(keep(t), group=self._group)
        self._loss = torch.zeros((), dtype=torch.float64)
        self._micro = 0
        self._window[0] += t[1].item()
        self._window[1] += t[2].item()
        return t[0].item() > 0

    def writes(self) -> bool:
        """Whether the hook writes records in this process (not when the script does)."""
        return self.aside is None and metrics.script_logged()[0] == 0

    def _record(self, steps: int, now: float, stats: dict[str, Any] | None) -> None:
        total, count = self._window
        self._window = [0.0, 0.0]
        if count:
            self.last_loss = total / count
            if self.first_loss is None:
                self.first_loss = self.last_loss
        rec: dict[str, Any] = {"loss": self.last_loss if count else None}
        if self._mark is not None and now > self._mark[0]:
            rate = (steps - self._mark[1]) / (now - self._mark[0])
            rec["steps_per_s"] = rate
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                rec["samples_per_s"] = rate * int(self.engine.train_batch_size())
        self._mark = (now, steps)
        with contextlib.suppress(AttributeError, IndexError, TypeError, ValueError):
            rec["lr"] = float(self.engine.get_lr()[0])
        if stats:
            rec.update(stats)
        if self.rank == 0 and self.writes():
            metrics.emit(step=steps, **rec)

    # --- the end ----------------------------------------------------------------------------

    def finish(self, reason: str) -> None:
        """End of training on every rank: the last outer round, then the final records.
        Safe to call twice; does nothing when the driver stood aside or never trained."""
        if self.finished or self.aside is not None or not self.started:
            self.finished = True
            return
        self.finished = True
        alive = self._distributed and dist.is_initialized()
        stats, error = None, None
        if self.sync is not None:
            try:
                if alive or self.world_size == 1:
                    stats = self.sync.finish(agree=reason != "SIGTERM",
                                             stop=lambda: self.stop_requested)
                else:
                    error = "the process group was already gone: no final outer round"
            except NebulaError as exc:
                error = str(exc)
            finally:
                self.sync.close()
            if error and self.rank == 0:
                say(f"final outer round failed: {error}; the clusters may end with different "
                    "parameters")
        if self.checkpointer is not None and (alive or self.world_size == 1):
            self.checkpointer.maybe_save(self.steps, final=True)
            self.checkpointer.close()
        if alive or self.world_size == 1:
            self._agree()  # the loss of the steps since the last record
            total, count = self._window
            if count:
                self.last_loss = total / count
                self.first_loss = self.last_loss if self.first_loss is None else self.first_loss
        checksum = param_checksum(self.engine)
        settle()  # before the interpreter may finalize: see runtime.settle
        if not self.writes():
            return
        if stats and self.rank == 0:
            metrics.emit(step=self.steps, **stats)
        synced = self.sync is not None and self.sync.mode != "dry-run"
        per_step = None
        done = self.steps - self._first_step  # optimizer steps trained by this process
        if self._t_first is not None and self._t_last is not None and done > 1:
            per_step = (self._t_last - self._t_first) / (done - 1)
        metrics.emit(
            step=self.steps, final=True, ended_by=reason, param_sha256=checksum,
            first_loss=self.first_loss, last_loss=self.last_loss, s_per_step=per_step,
            cross_cluster_sync=synced, outer_rounds=self.sync.round if synced else 0,
            final_round=bool(stats and stats.get("final_round")), final_round_error=error,
            final_round_present=stats.get("clusters_present") if stats else None,
            resumed_from_step=self.resumed_from)
        if self.rank == 0:
            rounds = f", {self.sync.round} outer round(s)" if synced else ""
            say(f"training ended ({reason}) after {self.steps} optimizer steps{rounds}; "
                f"parameters sha256 {checksum}")
