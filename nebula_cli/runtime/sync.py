"""OuterSync: the cross-cluster synchronisation a training script wraps around its DeepSpeed engine.

DiLoCo mode (default): every ``inner_steps`` optimizer steps each cluster forms the
pseudo-gradient ``delta = theta_global - theta_local`` (fp32, read from DeepSpeed's fp32
master copy), the cluster's rank 0 averages it with the other clusters through an
:class:`Averager` (the relay), the average is broadcast inside the cluster, and every rank
applies the outer optimizer (Nesterov SGD) to ``theta_global`` and writes the result into its
parameters *and* the fp32 master copy, so that the next ``engine.step()`` keeps it.
Gradient mode: every optimizer step the (cluster-averaged) gradients are averaged across
clusters between ``engine.backward`` and ``engine.step``.

Only parameters with ``requires_grad`` travel, in ``named_parameters`` order, flattened into
one fp32 vector (parameter-efficient training syncs only its adapters).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nebula_cli.config.parts import SYNC_CONFIG_ENV, SyncConfig
from nebula_cli.errors import NebulaError
from nebula_cli.runtime.metrics import DRY_RUN_ENV
from nebula_cli.runtime.metrics import log as log_metrics

MODES = ("diloco", "gradient")


def wanted() -> bool:
    """Whether this process should wrap its engine in an OuterSync: the job's plan gave it a
    sync config ($NEBULA_SYNC_CONFIG), or it runs in `nebula plan`'s dry run ($NEBULA_DRY_RUN)."""
    return bool(os.environ.get(SYNC_CONFIG_ENV) or os.environ.get(DRY_RUN_ENV))


def plan_config() -> SyncConfig | None:
    """This worker's part of the job plan (sync.json named by $NEBULA_SYNC_CONFIG), if any."""
    path = os.environ.get(SYNC_CONFIG_ENV)
    if not path:
        return None
    try:
        return SyncConfig.load(path)
    except NebulaError as exc:
        raise SyncError(f"cannot use the sync config: {exc}") from exc


log = logging.getLogger("nebula.runtime.sync")


class SyncError(NebulaError):
    """The outer synchronisation cannot be set up for this engine, or a round failed."""


class AveragedRound(Protocol):
    """What an averager returns for one round (``relay.client.RoundResult`` has this shape).

    Optional attribute ``global_state`` (a tensor or None): set when this cluster was behind;
    it is then theta_global after round ``round_id`` and replaces ours (no outer step).
    """

    tensor: torch.Tensor  # the average over the clusters present, flat fp32 CPU
    present: list[str]  # names of the clusters whose contribution is in the average
    round_id: int
    bytes_sent: int
    bytes_received: int
    seconds: float


class Averager(Protocol):
    """Averages one flat fp32 CPU tensor per round across the clusters (the relay client).

    Optional method ``publish_state(round_id, tensor)``: when present, rank 0 hands it
    theta_global after every applied round, for clusters that fall behind to catch up from.
    """

    def allreduce(self, round_id: int, tensor: torch.Tensor) -> AveragedRound: ...

    def close(self) -> None: ...


class OuterOptimizer:
    """SGD with (Nesterov) momentum on ``theta_global``; the averaged delta is its gradient.

    ``v = mu * v + g``; ``theta -= lr * (g + mu * v)`` with Nesterov, else ``theta -= lr * v``.
    """

    def __init__(self, lr: float, momentum: float, nesterov: bool) -> None:
        if not (math.isfinite(lr) and lr > 0):
            raise SyncError(f"outer learning rate must be a positive number, got {lr!r}")
        if not (math.isfinite(momentum) and 0 <= momentum < 1):
            raise SyncError(f"outer momentum must be in [0, 1), got {momentum!r}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.momentum_buffer: torch.Tensor | None = None

    def step(self, theta: torch.Tensor, grad: torch.Tensor) -> None:
        """Update ``theta`` in place with ``grad`` (both flat fp32 of the same size)."""
        if grad.shape != theta.shape:
            raise SyncError(f"outer gradient has {grad.numel()} elements, expected {theta.numel()}")
        grad = grad.to(dtype=theta.dtype, device=theta.device)
        if self.momentum_buffer is None:
            self.momentum_buffer = torch.zeros_like(theta)
        v = self.momentum_buffer
        v.mul_(self.momentum).add_(grad)
        update = grad.add(v, alpha=self.momentum) if self.nesterov else v
        theta.add_(update, alpha=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        buf = None if self.momentum_buffer is None else self.momentum_buffer.clone()
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov,
                "momentum_buffer": buf}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buf = state.get("momentum_buffer")
        self.momentum_buffer = None if buf is None else buf.detach().to(torch.float32).clone()


@dataclass
class _Shared:
    """A round's outcome as every rank of the cluster sees it after the broadcast."""

    round_id: int  # the round applied (a caught-up cluster: the round of the global state)
    avg: torch.Tensor | None  # the average over the clusters present
    state: torch.Tensor | None  # set when this cluster was behind: a peer's theta_global
    present: int
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    clusters: list[str] | None = None  # names, known on rank 0 only


# --- reading and writing the fp32 master values of the synced parameters -------------------


class _ParamIO:
    """Reads/writes the synced parameters as one flat fp32 CPU vector (all ranks call both)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.shapes = [_full_shape(p) for p in params]
        self.numels = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.numels)

    def read(self) -> torch.Tensor:
        parts = [self._read_one(i, p) for i, p in enumerate(self.params)]
        if not parts:
            return torch.zeros(0, dtype=torch.float32)
        return torch.cat([t.detach().to("cpu", torch.float32).reshape(-1) for t in parts])

    def write(self, flat: torch.Tensor) -> None:
        for i, value in enumerate(self._split(flat)):
            self._write_one(i, self.params[i], value)

    def _split(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        offset = 0
        for shape, n in zip(self.shapes, self.numels, strict=True):
            yield flat.narrow(0, offset, n).view(shape)
            offset += n

    def _read_one(self, i: int, p: torch.nn.Parameter) -> torch.Tensor:
        raise NotImplementedError

    def _write_one(self, i: int, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        raise NotImplementedError


class _DirectIO(_ParamIO):
    """fp32 parameters and no master copy (ZeRO 0, fp32): ``p.data`` is the master."""

    def _read_one(self, i: int, p: torch.nn.Parameter) -> torch.Tensor:
        return p.data

    def _write_one(self, i: int, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        p.data.copy_(value)


class _MasterCopyIO(_ParamIO):
    """ZeRO 0 with bf16/fp16: the fp32 master lives in DeepSpeed's FP16_(Unfused)Optimizer."""

    def __init__(self, params: list[torch.nn.Parameter], masters: list[torch.Tensor]) -> None:
        super().__init__(params)
        self.masters = masters

    def _read_one(self, i: int, p: torch.nn.Parameter) -> torch.Tensor:
        return self.masters[i]

    def _write_one(self, i: int, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        self.masters[i].copy_(value)
        p.data.copy_(value)


class _ZeroIO(_ParamIO):
    """ZeRO 1/2 (and DeepSpeed's BF16_Optimizer): fp32 master partitions behind ``_hp_mapping``.

    ``safe_get_full_fp32_param`` is a collective over the data-parallel group.
    """

    def _read_one(self, i: int, p: torch.nn.Parameter) -> torch.Tensor:
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(p)

    def _write_one(self, i: int, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        safe_set_full_fp32_param(p, value.to(p.device))
        p.data.copy_(value)  # the low-precision copy the next forward uses


class _Zero3IO(_ZeroIO):
    """ZeRO 3: fp32 master partitions, and partitioned parameters rewritten while gathered."""

    def __init__(self, params: list[torch.nn.Parameter], rank: int) -> None:
        super().__init__(params)
        self.rank = rank

    def write(self, flat: torch.Tensor) -> None:
        from deepspeed.runtime.zero import GatheredParameters

        values = list(self._split(flat))
        for p, value in zip(self.params, values, strict=True):
            _set_zero3_fp32(p, value.to(p.ds_tensor.device))
        # Every rank holds the same values; rank 0's are broadcast and re-partitioned on exit.
        with GatheredParameters(self.params, modifier_rank=0):
            if self.rank == 0:
                for p, value in zip(self.params, values, strict=True):
                    p.data.copy_(value)


def _set_zero3_fp32(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    """``safe_set_full_fp32_param`` for ZeRO 3, also when the last partition is padded.

    DeepSpeed 0.19's own version narrows past the end of ``value`` on the rank holding the
    padded tail (a parameter whose size is not a multiple of the world size).
    """
    opt = p._z3_optimizer
    try:
        part, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False)
        part_rank = opt._get_param_partition_rank(p)
    except AttributeError:  # another DeepSpeed version: use the public helper
        from deepspeed.utils import safe_set_full_fp32_param

        safe_set_full_fp32_param(p, value)
        return
    start = part.numel() * part_rank
    n = max(0, min(part.numel(), value.numel() - start))
    if n:
        part.data.narrow(0, 0, n).copy_(value.reshape(-1).narrow(0, start, n))


def _full_shape(p: torch.nn.Parameter) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def _wrapper_masters(optimizer: Any, params: list[torch.nn.Parameter]) -> list[torch.Tensor] | None:
    """The fp32 master tensor of each param inside FP16_Optimizer / FP16_UnfusedOptimizer."""
    lp_groups = getattr(optimizer, "fp16_groups", None)
    if lp_groups is None:
        return None
    by_id: dict[int, torch.Tensor] = {}
    if hasattr(optimizer, "fp32_groups_flat"):  # FP16_Optimizer: one flat fp32 buffer per group
        for group, flat in zip(lp_groups, optimizer.fp32_groups_flat, strict=True):
            offset = 0
            for p in group:
                by_id[id(p)] = flat.detach().narrow(0, offset, p.numel()).view(p.shape)
                offset += p.numel()
    elif hasattr(optimizer, "fp32_groups"):  # FP16_UnfusedOptimizer: one fp32 clone per param
        for group, masters in zip(lp_groups, optimizer.fp32_groups, strict=True):
            for p, m in zip(group, masters, strict=True):
                by_id[id(p)] = m.detach()
    else:
        return None
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise SyncError(
            f"{len(missing)} trainable parameter(s) are not in DeepSpeed's optimizer; "
            "pass all parameters that require gradients to deepspeed.initialize"
        )
    return [by_id[id(p)] for p in params]


def _zero_stage(engine: Any) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else 0


def _make_io(engine: Any, params: list[torch.nn.Parameter], rank: int) -> _ParamIO:
    stage = _zero_stage(engine)
    if any(hasattr(p, "ds_id") for p in params):
        return _Zero3IO(params, rank)
    if stage >= 1 or any(hasattr(p, "_hp_mapping") for p in params):
        if not all(hasattr(p, "_hp_mapping") for p in params):
            raise SyncError(
                f"ZeRO stage {stage}: some trainable parameters have no fp32 master partition; "
                "pass all parameters that require gradients to deepspeed.initialize"
            )
        return _ZeroIO(params)
    masters = _wrapper_masters(getattr(engine, "optimizer", None), params)
    if masters is not None:
        return _MasterCopyIO(params, masters)
    if all(p.dtype == torch.float32 for p in params):
        return _DirectIO(params)
    optimizer = type(getattr(engine, "optimizer", None)).__name__
    raise SyncError(
        f"cannot find the fp32 master copy of the {params[0].dtype} parameters "
        f"(ZeRO stage {stage}, optimizer {optimizer}); use ZeRO stage 1 or higher with bf16/fp16"
    )


# --- environment -----------------------------------------------------------------------------


def _env(name: str, default: Any, parse: Callable[[str], Any], check: Callable[[Any], bool],
         expected: str) -> Any:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not check(value):
        raise SyncError(f"{name}={raw!r}: expected {expected}")
    return value


def _env_bool(name: str, default: bool) -> bool:
    table = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
    return _env(name, default, lambda s: table.get(s.lower()), lambda v: v is not None, "0 or 1")


class OuterSync:
    """Cross-cluster sync around a DeepSpeed engine. Construct it on every rank of the cluster,
    after ``deepspeed.initialize`` and before the first step.

    Call order in a training loop::

        sync = OuterSync(engine)
        for step, batch in enumerate(loader):
            loss = engine(batch)
            engine.backward(loss)
            sync.after_backward()        # gradient mode: averages grads across clusters
            engine.step()
            stats = sync.after_step(step)  # DiLoCo mode: a dict after each outer round
        sync.flush()                     # overlap mode: apply the round still in flight
        sync.close()

    Both hooks may always be called; the one that does not belong to the mode is a no-op.

    DiLoCo: a round happens after every ``inner_steps`` optimizer steps (``engine.global_steps``,
    so gradient-accumulation micro-steps do not count). All ranks read theta_local from the fp32
    master, the cluster's rank 0 (torch.distributed rank 0) calls ``averager.allreduce`` and
    broadcasts the average to the other ranks (gloo, CPU), every rank applies the outer
    optimizer and writes theta_global into its parameters and fp32 master copy. The inner
    optimizer state (Adam moments) is kept.

    ``overlap=True`` (as in Streaming DiLoCo): at a boundary the round's delta (everything not
    yet averaged) is sent in a background thread and training goes on; once the average has
    arrived the outer step is applied once and the parameters become ``theta_global`` plus the
    cluster's own progress since the boundary. When: ``overlap_steps=None`` (default) at the
    first step after it arrived (rank 0 tells the cluster's ranks by a one-value broadcast per
    step while a round is in flight), at the latest at the next boundary; ``overlap_steps=k``
    exactly k steps after the boundary, waiting for it if needed (``k >= inner_steps``: at the
    next boundary, one round late).

    A round in which no cluster was present (an empty ``present``) changes nothing: the local
    progress carries into the next round's delta. A result with ``global_state`` (this cluster
    was behind) replaces theta_global and the parameters, and the round counter jumps past it.

    Gradient mode (ZeRO stage 0 only): ``after_backward`` replaces the cluster-averaged
    gradients with the average over clusters at each gradient-accumulation boundary.

    Supported: pure data parallelism inside a cluster (ZeRO 0 fp32, ZeRO 0 bf16/fp16 through
    DeepSpeed's FP16_(Unfused)Optimizer master copy, ZeRO 1/2/3 in any precision).
    """

    def __init__(
        self,
        engine: Any,
        *,
        averager: Averager | None = None,
        config: SyncConfig | None = None,
        inner_steps: int | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        nesterov: bool | None = None,
        mode: str | None = None,
        overlap: bool | None = None,
        overlap_steps: int | None = None,
        round_timeout: float | None = None,
    ) -> None:
        self.engine = engine
        self.dry_run = _env_bool(DRY_RUN_ENV, False)
        self.config = config if config is not None else plan_config()
        given = {"inner_steps": inner_steps, "outer_lr": outer_lr,
                 "outer_momentum": outer_momentum, "nesterov": nesterov, "mode": mode,
                 "overlap": overlap, "round_timeout": round_timeout}
        if self.config is None and self.dry_run:
            # `nebula plan`'s dry run: no relay and no round; only the parameter count matters
            given = {k: v for k, v in given.items() if v is not None}
            given["mode"] = "dry-run"
        settings = self._settings(given, overlap_steps)
        self.mode = str(settings["mode"]).lower()
        if self.mode not in (*MODES, "dry-run"):
            raise SyncError(f"sync mode {self.mode!r}: expected one of {', '.join(MODES)}")
        self.inner_steps = int(settings.get("inner_steps") or 0)
        if self.mode != "dry-run" and self.inner_steps < 1:
            raise SyncError(f"inner_steps must be at least 1, got {self.inner_steps}")
        self.overlap = bool(settings.get("overlap"))
        if self.overlap and self.mode == "gradient":
            raise SyncError("overlap applies to DiLoCo rounds; gradient mode cannot overlap")
        self.overlap_steps: int | None = settings.get("overlap_steps")
        if self.overlap_steps is not None and self.overlap_steps < 1:
            raise SyncError(f"overlap_steps must be at least 1, got {self.overlap_steps}")
        self.outer = OuterOptimizer(settings["outer_lr"], settings["outer_momentum"],
                                    settings["nesterov"]) if self.mode != "dry-run" else None
        self.round_timeout = float(settings.get("round_timeout") or 0.0)

        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        self._group = None
        if self.world_size > 1 and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # CPU broadcasts beside NCCL

        module = getattr(engine, "module", engine)
        self.param_names = [n for n, p in module.named_parameters()
                            if p.requires_grad and _full_shape(p).numel() > 0]
        params = [p for _, p in module.named_parameters()
                  if p.requires_grad and _full_shape(p).numel() > 0]
        if not params:
            raise SyncError("the model has no parameters that require gradients: nothing to sync")
        self._params = params
        if self.mode == "gradient":
            self._check_gradient_mode()
            self._io: _ParamIO | None = None
            self.numel = sum(_full_shape(p).numel() for p in params)
            self.theta_global = torch.zeros(0)
        else:
            self._io = _make_io(engine, params, self.rank)
            self.numel = self._io.numel
            self.theta_global = self._io.read().clone()
        self._anchor: torch.Tensor | None = None  # overlap: params as of the last boundary
        self.round = 0  # outer rounds started so far (= the next round id)
        self.grad_round = 0  # gradient-mode exchanges so far
        self._calls = 0
        self._last_round_step = self._optimizer_steps()
        self._averager = averager
        self._thread: threading.Thread | None = None
        self._pending: dict[str, Any] | None = None
        self._closed = False
        if self.dry_run and self.rank == 0:  # what `nebula plan` needs; no round will run
            log_metrics(step=0, dry_run=True, trainable_params=self.numel)

    def _settings(self, given: dict[str, Any], overlap_steps: int | None) -> dict[str, Any]:
        """Each setting from the arguments, else from the plan's sync config (the spec's)."""
        out = {}
        for name, value in given.items():
            if value is None:
                if self.config is None:
                    raise SyncError(
                        f"{name} was not given and there is no sync config "
                        f"(${SYNC_CONFIG_ENV}): OuterSync takes its settings from the job's "
                        f"plan under `nebula launch`, or from config=SyncConfig(...)")
                value = getattr(self.config, name)
            out[name] = value
        out["overlap_steps"] = overlap_steps if overlap_steps is not None else (
            self.config.overlap_steps if self.config else None)
        return out

    # --- public hooks ---------------------------------------------------------------------

    def after_step(self, step: int | None = None) -> dict[str, Any] | None:
        """Call after every ``engine.step()`` (``step`` is informational); runs an outer round
        once ``inner_steps`` optimizer steps have passed since the last one.

        Returns None, or after a round a dict: outer_round, round_s, relay_s,
        wan_bytes_sent, wan_bytes_received, clusters_present (count; rank 0 also gets
        ``clusters``, the names), delta_norm (this cluster's), avg_delta_norm, applied (False
        for a round just started in overlap mode, whose average is applied later; overlap mode
        also returns the stats of a round whose average it applied after a step between
        boundaries, with ``merged_after_steps``).
        """
        self._check_open()
        self._calls += 1
        if self.mode != "diloco" or self.dry_run:
            return None
        steps = self._optimizer_steps()
        since = steps - self._last_round_step
        if since < self.inner_steps:
            if self.overlap and self._pending is not None and self._merge_due(since):
                return self._merge(since)
            return None
        self._last_round_step = steps
        return self._overlapped_round() if self.overlap else self._sync_round()

    def after_backward(self) -> dict[str, Any] | None:
        """Gradient mode: call between ``engine.backward`` and ``engine.step``; averages the
        gradients across clusters at each accumulation boundary. No-op in DiLoCo mode."""
        self._check_open()
        if self.mode != "gradient" or self.dry_run:
            return None
        if hasattr(self.engine, "is_gradient_accumulation_boundary") and \
                not self.engine.is_gradient_accumulation_boundary():
            return None
        t0 = time.perf_counter()
        parts = []
        for p in self._params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            parts.append(g.detach().to("cpu", torch.float32).reshape(-1))
        grad = torch.cat(parts)
        round_id = self.grad_round
        self.grad_round += 1
        shared = self._exchange(round_id, grad)
        if shared.avg is not None and shared.present > 0:
            offset = 0
            for p in self._params:
                n = p.numel()
                value = shared.avg.narrow(0, offset, n).view(p.shape)
                if p.grad is None:
                    p.grad = value.to(p.device, p.dtype).clone()
                else:
                    p.grad.copy_(value)
                offset += n
        # else: no average this step (nobody present): the cluster's own gradients are used
        return self._stats(shared, t0, grad)

    def flush(self) -> dict[str, Any] | None:
        """Overlap mode: wait for the round in flight and apply it (call on every rank at the
        end of training, before a final checkpoint). No-op otherwise."""
        self._check_open()
        if not (self.overlap and self._pending is not None):
            return None
        return self._merge(self._optimizer_steps() - self._last_round_step)

    def close(self) -> None:
        """Close the averager and join a round still in flight (bounded). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=min(self.round_timeout, 30.0))
            self._thread = None
        if self._averager is not None:
            self._averager.close()

    def __enter__(self) -> OuterSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The outer state to store beside DeepSpeed's checkpoint (an in-flight overlapped
        round is not included: call ``flush()`` first to keep it)."""
        return {
            "mode": self.mode,
            "round": self.round,
            "grad_round": self.grad_round,
            "last_round_step": self._last_round_step,
            "theta_global": self.theta_global.clone(),
            "anchor": None if self._anchor is None else self._anchor.clone(),
            "outer": self.outer.state_dict(),
            "param_names": list(self.param_names),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the outer state (parameters themselves come from DeepSpeed's checkpoint)."""
        if state.get("param_names", self.param_names) != self.param_names:
            raise SyncError(
                "outer sync state was saved for a different set of trainable parameters")
        theta = state["theta_global"]
        if self.mode == "diloco" and theta.numel() != self.numel:
            raise SyncError(f"outer sync state has {theta.numel()} values, expected {self.numel}")
        self.theta_global = theta.detach().to("cpu", torch.float32).clone()
        anchor = state.get("anchor")
        self._anchor = None if anchor is None else anchor.detach().to("cpu", torch.float32).clone()
        self.round = int(state["round"])
        self.grad_round = int(state.get("grad_round", 0))
        self._last_round_step = int(state["last_round_step"])
        self.outer.load_state_dict(state["outer"])

    # --- rounds ---------------------------------------------------------------------------

    def _sync_round(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        delta = self.theta_global - self._io.read()
        round_id = self.round
        self.round += 1
        shared = self._exchange(round_id, delta)
        if self._apply(shared):
            self._io.write(self.theta_global)
        # else: nobody's average this round; the local progress carries into the next delta
        return self._stats(shared, t0, delta)

    def _overlapped_round(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        merged = self._merge(self.inner_steps) if self._pending is not None else None
        theta_local = self._io.read()
        delta = self.theta_global - theta_local  # everything not yet averaged
        self._anchor = theta_local
        round_id = self.round
        self.round += 1
        self._start_pending(round_id, delta)
        if merged is not None:  # the previous round's stats (its average applied just now)
            return merged
        shared = _Shared(round_id=round_id, avg=None, state=None, present=0)
        return self._stats(shared, t0, delta)

    def _merge_due(self, since: int) -> bool:
        """Whether the round in flight is applied after this step (the same answer on every
        rank of the cluster)."""
        if self.overlap_steps is not None:
            return since >= self.overlap_steps
        arrived = torch.zeros(1, dtype=torch.int32)
        if self.rank == 0:
            arrived[0] = int(self._thread is None or not self._thread.is_alive())
        self._broadcast(arrived)
        return bool(arrived.item())

    def _merge(self, since: int) -> dict[str, Any]:
        """Wait for the round in flight, apply its average once, keep the progress made since
        its boundary on top of the new theta_global."""
        t0 = time.perf_counter()
        progress = self._anchor - self._io.read()  # steps taken since the boundary
        shared = self._finish_pending()
        if self._apply(shared):
            self._io.write(self.theta_global - progress)
        # else: nobody's average; the progress carries into the next delta
        stats = self._stats(shared, t0, progress)
        stats["merged_after_steps"] = since
        return stats

    def _apply(self, shared: _Shared) -> bool:
        """Apply one round's outcome to theta_global; False when there was nothing to apply."""
        if shared.state is not None:  # this cluster was behind: take a peer's global state
            self.theta_global = shared.state.clone()
            self.round = max(self.round, shared.round_id + 1)
            return True
        if shared.present == 0:
            return False
        self.outer.step(self.theta_global, shared.avg)
        self._publish(shared.round_id)
        return True

    def _publish(self, round_id: int) -> None:
        """Rank 0 hands theta_global to the relay, for clusters that fall behind to catch up."""
        publish = getattr(self._averager, "publish_state", None) if self.rank == 0 else None
        if publish is None:
            return
        try:
            publish(round_id, self.theta_global)
        except Exception as exc:  # catching up is best effort; training goes on
            log.warning("outer round %d: could not publish the global state: %s", round_id, exc)

    # --- exchange: rank 0 talks to the averager, the cluster gets the result by broadcast ----

    def _exchange(self, round_id: int, tensor: torch.Tensor) -> _Shared:
        result = error = None
        if self.rank == 0:
            try:
                result = self._get_averager().allreduce(round_id, tensor.contiguous())
            except Exception as exc:  # every rank must leave the broadcast, then raise
                error = exc
        return self._share(round_id, result, error)

    def _start_pending(self, round_id: int, tensor: torch.Tensor) -> None:
        pending: dict[str, Any] = {"round_id": round_id, "result": None, "error": None}
        self._pending = pending
        if self.rank != 0:
            return
        averager = self._get_averager()

        def run() -> None:
            try:
                pending["result"] = averager.allreduce(round_id, tensor)
            except Exception as exc:
                pending["error"] = exc

        self._thread = threading.Thread(target=run, name=f"nebula-outer-{round_id}", daemon=True)
        self._thread.start()

    def _finish_pending(self) -> _Shared:
        pending, self._pending = self._pending, None
        if pending is None:  # pragma: no cover - callers check
            raise SyncError("no outer round in flight")
        if self.rank == 0 and self._thread is not None:
            wait = self.round_timeout + 60.0
            self._thread.join(timeout=wait)
            if self._thread.is_alive():
                pending["error"] = SyncError(
                    f"outer round {pending['round_id']}: no result after {wait:.0f} s")
            self._thread = None
        return self._share(pending["round_id"], pending["result"], pending["error"])

    def _share(self, round_id: int, result: Any, error: BaseException | None) -> _Shared:
        """Rank 0's round outcome (or failure), broadcast to every rank of the cluster."""
        header = torch.zeros(7, dtype=torch.float64)
        payload = None
        if self.rank == 0:
            if error is None:
                payload, state, error = self._check_result(round_id, result)
            if error is None:
                header = torch.tensor(
                    [1.0, len(result.present), result.bytes_sent, result.bytes_received,
                     result.seconds, int(getattr(result, "round_id", round_id)),
                     float(state)], dtype=torch.float64)
        self._broadcast(header)
        if header[0].item() != 1.0:
            if self.rank == 0:
                if isinstance(error, NebulaError):
                    raise error
                raise SyncError(f"outer round {round_id} failed: {error}") from error
            raise SyncError(f"outer round {round_id} failed on this cluster's rank 0 (see its log)")
        if payload is None:
            payload = torch.empty(self.numel, dtype=torch.float32)
        self._broadcast(payload)
        has_state = header[6].item() == 1.0
        return _Shared(
            round_id=int(header[5].item()) if has_state else round_id,
            avg=None if has_state else payload, state=payload if has_state else None,
            present=int(header[1].item()), bytes_sent=int(header[2].item()),
            bytes_received=int(header[3].item()), seconds=header[4].item(),
            clusters=list(result.present) if self.rank == 0 else None)

    def _check_result(self, round_id: int, result: Any
                      ) -> tuple[torch.Tensor | None, bool, BaseException | None]:
        """(the tensor to broadcast, whether it is a global state, an error)."""
        state = getattr(result, "global_state", None)
        tensor = state if state is not None else getattr(result, "tensor", None)
        what = "global state" if state is not None else "average"
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != self.numel:
            got = tensor.numel() if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            return None, False, SyncError(f"outer round {round_id}: the averager returned a "
                                          f"{what} of {got} values, expected {self.numel}")
        flat = tensor.detach().to("cpu", torch.float32).reshape(-1).contiguous()
        if not bool(torch.isfinite(flat).all()):
            return None, False, SyncError(f"outer round {round_id}: the {what} is not finite")
        return flat, state is not None, None

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.broadcast(tensor, src=0, group=self._group)

    # --- helpers --------------------------------------------------------------------------

    def _get_averager(self) -> Averager:
        if self._averager is None:
            from nebula_cli.relay.client import RelayClient

            cfg = self.config
            if cfg is None:
                raise SyncError(f"no relay to average with: ${SYNC_CONFIG_ENV} is not set "
                                f"(run under `nebula launch` with a relay, or pass averager=)")
            self._averager = RelayClient(
                cfg.relay_addr, ca=cfg.tls.ca, cert=cfg.tls.cert, key=cfg.tls.key,
                job_id=cfg.job_id, cluster=cfg.cluster, round_timeout=cfg.round_timeout)
        return self._averager

    def _optimizer_steps(self) -> int:
        steps = getattr(self.engine, "global_steps", None)
        return int(steps) if isinstance(steps, int) else self._calls

    def _check_open(self) -> None:
        if self._closed:
            raise SyncError("this OuterSync is closed")

    def _check_gradient_mode(self) -> None:
        engine = self.engine
        stage = _zero_stage(engine)
        if stage != 0:
            raise SyncError(f"gradient mode supports ZeRO stage 0 only (this engine: stage "
                            f"{stage}); use DiLoCo mode with ZeRO")
        if hasattr(engine, "fp16_enabled") and engine.fp16_enabled():
            raise SyncError("gradient mode does not support fp16 (loss-scaled gradients differ "
                            "between clusters); use bf16 or fp32")
        managed = getattr(engine, "managed_gradient_accumulation", None)
        if callable(managed) and not managed():
            raise SyncError("gradient mode needs DeepSpeed's managed gradient accumulation")

    def _stats(self, shared: _Shared, t0: float, delta: torch.Tensor) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "outer_round": shared.round_id,
            "round_s": time.perf_counter() - t0,
            "relay_s": shared.seconds,
            "wan_bytes_sent": shared.bytes_sent,
            "wan_bytes_received": shared.bytes_received,
            "clusters_present": shared.present,
            "delta_norm": float(delta.norm()),
            "avg_delta_norm": None if shared.avg is None else float(shared.avg.norm()),
            "applied": (shared.avg is not None and shared.present > 0) or shared.state is not None,
            "caught_up": shared.state is not None,
        }
        if shared.clusters is not None:
            stats["clusters"] = shared.clusters
        return stats
