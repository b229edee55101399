"""OuterSync: the cross-cluster synchronisation a training script wraps around its DeepSpeed engine.

DiLoCo mode (default): every ``inner_steps`` optimizer steps each cluster forms the
pseudo-gradient ``delta = theta_global - theta_local`` (fp32, read from DeepSpeed's fp32
master copy; each rank holds and forms its own shard of it, runtime/shard.py), the cluster's
rank 0 gathers it and averages it with the other clusters through an :class:`Averager` (the
relay), the average is scattered inside the cluster, and every rank applies the outer
optimizer (Nesterov SGD) to its shard of ``theta_global``; the shards are joined into every
rank's parameters *and* the fp32 master copy, so that the next ``engine.step()`` keeps them.
Gradient mode: every optimizer step the (cluster-averaged) gradients are averaged across
clusters between ``engine.backward`` and ``engine.step``.

Only parameters with ``requires_grad`` travel, in ``named_parameters`` order, flattened into
one fp32 vector (parameter-efficient training syncs only its adapters).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nebula_cli.config.parts import SyncConfig
from nebula_cli.heap import HeapTrim
from nebula_cli.runtime import checkpoint as checkpoints
from nebula_cli.runtime import outer_files, worldwatch
from nebula_cli.runtime.cadence import Cadence
from nebula_cli.runtime.cluster_share import (
    AveragedRound,
    Averager,
    ClusterShare,
    Shared,
    round_stats,
)
from nebula_cli.runtime.explicit import note_outer_sync
from nebula_cli.runtime.final import final_agreement
from nebula_cli.runtime.inflight import InFlight
from nebula_cli.runtime.metrics import DRY_RUN_ENV
from nebula_cli.runtime.metrics import emit as log_metrics
from nebula_cli.runtime.outer import OuterOptimizer, SyncError
from nebula_cli.runtime.params import ParamIO, check_gradient_mode, full_shape, make_io
from nebula_cli.runtime.settings import (
    LAYOUT_BYTES,
    outer_by_codec,
    plan_config,
    relay_client,
    resolve_settings,
    sync_layout,
    wanted,
)
from nebula_cli.runtime.settle import release, settle

MODES = ("diloco", "gradient")
__all__ = [
    "LAYOUT_BYTES", "MODES", "Averager", "AveragedRound", "OuterOptimizer", "OuterSync",
    "SyncError", "plan_config", "sync_layout", "wanted",
]
log = logging.getLogger("nebula.runtime.sync")


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
        sync.finish(stop=term.is_set)    # one last round: every cluster ends identical
        sync.close()

    ``stop`` (optional): true once the script was asked to stop (``term``: a threading.Event
    its SIGTERM handler sets); it ends the wait for the other clusters to finish.

    Both hooks may always be called; the one that does not belong to the mode is a no-op.
    Building an OuterSync on an engine tells the automatic hook (``runtime.engine``) to leave
    that engine to this object.

    DiLoCo: a round happens after every ``inner_steps`` optimizer steps (``engine.global_steps``).
    The outer state is sharded (``runtime/shard.py``): each rank holds its contiguous shard of
    theta_global and of the outer momentum. Each rank reads its shard of theta_local from the
    fp32 master, rank 0 gathers the cluster's delta and calls ``averager.allreduce``, scatters
    the average (gloo, CPU, point to point), every rank applies the outer optimizer to its
    shard (with the round's codec's settings under ``compression: auto``), and the shards are
    joined, a run of parameters at a time, into every rank's parameters and fp32 master copy.
    The inner optimizer state (Adam moments) is kept.

    ``overlap=True`` (as in Streaming DiLoCo): at a boundary the round's delta (everything not
    yet averaged) is sent in a background thread and training goes on; once the average has
    arrived the outer step is applied once and the parameters become ``theta_global`` plus the
    cluster's own progress since the boundary, waiting for it if needed: ``overlap_steps=k``
    exactly k steps after the boundary (``k >= inner_steps``: one round late); by default at the
    step the relays agreed from the last rounds' times (``Cadence.merge_steps``: the same on
    every cluster; 1 until they have); at the latest at the next boundary.

    A round with no cluster present changes nothing (the progress carries into the next delta);
    one with ``global_state`` (this cluster was behind) replaces theta_global and the
    parameters, and the round counter jumps past it. Gradient mode (ZeRO stage 0 only):
    ``after_backward`` replaces the gradients with the average over clusters at each
    gradient-accumulation boundary. Supported: pure data parallelism inside a cluster (ZeRO 0
    fp32, ZeRO 0 bf16/fp16 through DeepSpeed's FP16_(Unfused)Optimizer, ZeRO 1/2/3).
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
        note_outer_sync(engine, self)  # the automatic hook stands aside for this engine
        worldwatch.start()  # (already running when the automatic hook is on)
        self.dry_run = os.environ.get(DRY_RUN_ENV, "").strip().lower() not in (
            "", "0", "false", "no")
        self.config = config if config is not None else plan_config()
        given = {"inner_steps": inner_steps, "outer_lr": outer_lr,
                 "outer_momentum": outer_momentum, "nesterov": nesterov, "mode": mode,
                 "overlap": overlap, "round_timeout": round_timeout}
        if self.config is None and self.dry_run:
            # `nebula plan`'s dry run: no relay and no round; only the parameter count matters
            given = {k: v for k, v in given.items() if v is not None}
            given["mode"] = "dry-run"
        settings = resolve_settings(given, overlap_steps, self.config)
        self.mode = str(settings["mode"]).lower()
        if self.mode not in (*MODES, "dry-run"):
            raise SyncError(f"sync mode {self.mode!r}: expected one of {', '.join(MODES)}")
        h = int(settings.get("inner_steps") or 0)
        if self.mode != "dry-run" and h < 1:
            raise SyncError(f"inner_steps must be at least 1, got {h}")
        self.overlap = bool(settings.get("overlap"))
        if self.overlap and self.mode == "gradient":
            raise SyncError("overlap applies to DiLoCo rounds; gradient mode cannot overlap")
        self.overlap_steps: int | None = settings.get("overlap_steps")
        if self.overlap_steps is not None and self.overlap_steps < 1:
            raise SyncError(f"overlap_steps must be at least 1, got {self.overlap_steps}")
        self.outer = OuterOptimizer(settings["outer_lr"], settings["outer_momentum"],
                                    settings["nesterov"]) if self.mode != "dry-run" else None
        self.round_timeout = float(settings.get("round_timeout") or 0.0)
        explicit = outer_lr is not None or outer_momentum is not None  # then for every round
        self._by_codec = outer_by_codec(None if explicit else self.config)

        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        self._group = None
        if self.world_size > 1 and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # CPU broadcasts beside NCCL

        module = getattr(engine, "module", engine)
        self.param_names = [n for n, p in module.named_parameters()
                            if p.requires_grad and full_shape(p).numel() > 0]
        params = [p for _, p in module.named_parameters()
                  if p.requires_grad and full_shape(p).numel() > 0]
        if not params:
            raise SyncError("the model has no parameters that require gradients: nothing to sync")
        self._params = params
        if self.mode == "gradient":
            check_gradient_mode(engine)
            self._io: ParamIO | None = None
            self.numel = sum(full_shape(p).numel() for p in params)
        else:
            self._io = make_io(engine, params, self.rank)
            self.numel = self._io.numel
        # DiLoCo: each rank holds its shard of the outer state (runtime/shard.py)
        self._cluster = ClusterShare(self.rank, self.world_size, self._group, self.numel,
                                     sharded=self.mode != "gradient")
        self.shard = self._cluster.moves.shard
        self.theta_global = torch.zeros(0) if self._io is None else self._read_shard()
        """This rank's shard of theta_global (the whole vector on a cluster of one rank)."""
        planned = self.config if inner_steps is None else None  # an explicit H: a fixed one
        self.cadence = Cadence(self._cluster, inner_steps=max(1, h),
                               every_s=planned.every_s if planned else None,
                               auto=bool(planned and planned.auto_steps))
        self._anchor: torch.Tensor | None = None  # overlap: params as of the last boundary
        self.round = 0  # outer rounds started so far (= the next round id)
        self.grad_round = 0  # gradient-mode exchanges so far
        self._calls = 0
        self._last_round_step = self._optimizer_steps()
        self._averager = averager
        self._inflight = InFlight()  # overlap: the round in flight
        self.heap = HeapTrim()  # after rounds, freed memory back to the system
        self._closed = False
        self.checkpointer: checkpoints.Checkpointer | None = None  # built by checkpoint()
        if self.dry_run and self.rank == 0:  # what `nebula plan` needs; no round will run
            log_metrics(step=0, dry_run=True, trainable_params=self.numel)

    # --- public hooks ---------------------------------------------------------------------

    def after_step(self, step: int | None = None) -> dict[str, Any] | None:
        """Call after every ``engine.step()`` (``step`` is informational); runs an outer round
        once ``inner_steps`` optimizer steps have passed since the last one.

        Returns None, or after a round a dict: outer_round, round_s, relay_s,
        wan_bytes_sent, wan_bytes_received, clusters_present (count; rank 0 also gets
        ``clusters``, the names), delta_norm (this cluster's), avg_delta_norm, applied (False
        for a round just started in overlap mode, whose average is applied later; overlap mode
        also returns the stats of a round whose average it applied after a step between
        boundaries, with ``merged_after_steps``). Overlap's timeline: ``boundary_s`` (a round's
        start), ``wait_s`` and ``apply_s`` (its merge), ``step_s_idle`` / ``step_s_in_flight``
        (a step's mean time without and with a round in flight).
        """
        self._check_open()
        self._calls += 1
        if self.mode != "diloco" or self.dry_run:
            return None
        self.cadence.step_done(self._inflight.active)
        try:
            stats = self._after_step()
        finally:
            self.cadence.mark()
        if stats is not None:
            self.heap.trim()  # what the round freed (its tensors, other threads'): nebula_cli.heap
        return stats

    def _after_step(self) -> dict[str, Any] | None:
        steps = self._optimizer_steps()
        since = steps - self._last_round_step
        if not self.cadence.due(since):
            if self.overlap and self._inflight.active and self._merge_due(since):
                return self._merge(since)
            return None
        self._last_round_step = steps
        info = self.cadence.info(since, self._samples_per_step())
        return self._overlapped_round(since, info) if self.overlap else self._sync_round(info)

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
        shared = self._exchange(round_id, grad if self.rank == 0 else None)
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
        return round_stats(shared, t0, self._cluster.norms(grad, shared.avg))

    def flush(self) -> dict[str, Any] | None:
        """Overlap mode: wait for the round in flight and apply it (call on every rank at the
        end of training, before a final checkpoint). No-op otherwise."""
        self._check_open()
        if not (self.overlap and self._inflight.active):
            return None
        return self._merge(self._optimizer_steps() - self._last_round_step)

    def finish(self, agree: bool = True, stop: Callable[[], bool] | None = None
               ) -> dict[str, Any] | None:
        """End of training, on every rank: apply the round in flight, then a last round over
        the steps since the last boundary (then, with ``agree``, the final state: runtime.final;
        not on SIGTERM; ``stop``, when it turns true on any rank, ends the wait for it).
        Returns that round's stats (``final_round``), the flushed round's."""
        self._check_open()
        if self.mode != "diloco" or self.dry_run:
            return None
        stats = self.flush()
        steps = self._optimizer_steps()
        if steps > self._last_round_step:
            info = self.cadence.info(steps - self._last_round_step, self._samples_per_step())
            self._last_round_step = steps
            stats = {**self._sync_round(info), "final_round": True}
        return stats if not agree else final_agreement(
            self._averager if self.rank == 0 else None, self._cluster, self._apply,
            lambda: self._write(self.theta_global), stats, stop)

    def close(self) -> None:
        """Close the averager and join a round still in flight (bounded); wait for the
        cluster's last collectives to be released (runtime.settle). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._inflight.join(timeout=min(self.round_timeout, 30.0))
        for part in (self.checkpointer, self._averager):
            if part is not None:
                part.close()
        settle()

    def __enter__(self) -> OuterSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- checkpoints ----------------------------------------------------------------------

    def checkpoint(self, step: int, *, final: bool = False) -> bool:
        """Save a checkpoint if the spec asks for one at `step` (see runtime.checkpoint)."""
        return checkpoints.save_due(self, step, final=final)

    def resume(self) -> int:
        """Load the newest checkpoint every rank has; its step, 0 if none (runtime.checkpoint)."""
        return checkpoints.resume(self)

    def saved_part(self) -> dict[str, Any]:
        """This rank's part of the outer state for a checkpoint (``runtime.outer_files``): its
        shard of each vector as it lies (written before training goes on: no copy, no gather)
        and what every rank holds alike. Not a collective."""
        buf = self.outer.momentum_buffer
        return {
            # (gradient mode holds no vector: every rank an empty piece, named by its rank)
            "rank": self.rank, "world": self.world_size, "numel": self.numel,
            "lo": self.shard.lo if self.mode == "diloco" else 0,
            "hi": self.shard.hi if self.mode == "diloco" else 0,
            "mode": self.mode,
            "round": self.round,
            "grad_round": self.grad_round,
            "last_round_step": self._last_round_step,
            "theta_global": self.theta_global.detach() if self.mode == "diloco" else None,
            "anchor": self._anchor,
            "momentum_buffer": None if buf is None or self.mode != "diloco" else buf,
            "outer": self.outer.state_dict(with_buffer=False),
            "param_names": list(self.param_names),
            "cadence": self.cadence.state_dict(),
        }

    def load_saved(self, saved: outer_files.Saved, *, contributes: bool) -> None:
        """Restore the outer state from a checkpoint's files on this host (``saved``, read by
        ``outer_files.read``): each rank's shard files assembled into this rank's shard
        whatever the rank count that wrote them, or one whole state (format 1); nothing when
        the checkpoint has none. A collective: every rank calls it; ``contributes``: one rank
        per host (its first)."""
        got = outer_files.assemble(saved, self._cluster.moves, contributes=contributes,
                                   sharded=self.mode == "diloco",
                                   param_names=list(self.param_names))
        if got is not None:
            self._restore(*got)

    def full_theta_global(self) -> torch.Tensor:
        """theta_global whole, on every rank (a collective on a cluster of several ranks)."""
        return self._cluster.moves.all_gather(self.theta_global).clone()

    def _restore(self, state: dict[str, Any], vectors: dict[str, torch.Tensor | None]) -> None:
        """The outer state's values from ``state`` and this rank's shard of each vector from
        ``vectors`` (memory of its own, taken as it is)."""
        if self.mode == "diloco":
            self.theta_global = vectors["theta_global"]
        self._anchor = vectors["anchor"]
        self.round = int(state["round"])
        self.grad_round = int(state.get("grad_round", 0))
        self._last_round_step = int(state["last_round_step"])
        self.outer.load_state_dict({**state["outer"], "momentum_buffer": None})
        self.outer.momentum_buffer = vectors["momentum_buffer"]
        self.cadence.load_state_dict(state.get("cadence") or {})

    # --- rounds ---------------------------------------------------------------------------

    def _sync_round(self, info: dict[str, float]) -> dict[str, Any]:
        t0 = time.perf_counter()
        delta, whole = self._delta(self._read_shard(), keep_local=False)
        round_id = self.round
        self.round += 1
        shared = self._exchange(round_id, whole, info)
        del whole
        if self._apply(shared):
            self._write(self.theta_global)
            self._publish(shared)
        # else: nobody's average this round; the local progress carries into the next delta
        release()  # the round's broadcast tensors go with `shared` (runtime/settle.py)
        stats = round_stats(shared, t0, self._cluster.norms(delta, shared.avg))
        self.cadence.restart(cost=stats["round_s"], next_round=shared.next)
        return stats

    def _overlapped_round(self, since: int, info: dict[str, float]) -> dict[str, Any]:
        merged = self._merge(since) if self._inflight.active else None
        info = {**info, **self.cadence.take_arrival()}  # (also of a round merged just now)
        t0 = time.perf_counter()
        theta_local = self._read_shard()
        delta, whole = self._delta(theta_local, keep_local=True)  # all not yet averaged
        self._anchor = theta_local
        round_id = self.round
        self.round += 1
        self._inflight.start(round_id, None if self.rank else  # (its errors reach every rank)
                             lambda: self._get_averager().allreduce(round_id, whole, info))
        self.cadence.restart()
        # the previous round's stats (its average applied just now), or this one's start
        stats = merged or round_stats(Shared(round_id=round_id, avg=None, state=None,
                                             present=0), t0, self._cluster.norms(delta, None))
        return {**stats, "boundary_s": time.perf_counter() - t0}

    def _merge_due(self, since: int) -> bool:
        """Whether the round in flight is applied after this step (the same answer on every
        rank of the cluster, and on every cluster): a fixed step, or the relays' agreed one."""
        return since >= (self.overlap_steps or self.cadence.merge_steps)

    def _merge(self, since: int) -> dict[str, Any]:
        """Wait for the round in flight, apply its average once, keep the progress made since
        its boundary on top of the new theta_global."""
        t0 = time.perf_counter()
        progress = self._anchor - self._read_shard()  # steps taken since the boundary
        shared = self._finish_pending()
        t1 = time.perf_counter()
        if self._apply(shared):
            self._write(self.theta_global - progress)
            self._publish(shared)
        # else: nobody's average; the progress carries into the next delta
        release()
        stats = round_stats(shared, t0, self._cluster.norms(progress, shared.avg))
        stats.update(wait_s=t1 - t0, apply_s=stats["round_s"] - (t1 - t0),
                     **self.cadence.step_times())  # the overlap's timeline
        self.cadence.pause(stats["round_s"])  # waiting for it and applying it: not training
        self.cadence.note_cost(shared.seconds)
        self.cadence.follow(shared.next)
        stats["merged_after_steps"] = since
        return stats

    def _apply(self, shared: Shared) -> bool:
        """Apply one round's outcome to theta_global; False when there was nothing to apply."""
        if shared.state is not None:  # behind, or diverged: take a peer's global state
            self.theta_global = shared.state.clone()
            if shared.momentum is not None:
                self.outer.momentum_buffer = shared.momentum.clone()
            self.round = max(self.round, shared.round_id + 1)
            return True
        if shared.present == 0:
            return False
        if shared.codec in self._by_codec:
            self.outer.lr, self.outer.momentum = self._by_codec[shared.codec]
        self.outer.step(self.theta_global, shared.avg)
        return True

    def _publish(self, shared: Shared) -> None:
        """After a round's average was applied, rank 0 hands theta_global and the outer
        momentum to the relay, for clusters that fall behind or diverge. On every rank: the
        shards are gathered on rank 0 when it said so."""
        if shared.state is not None or not shared.publish:
            return
        moves = self._cluster.moves
        buf = self.outer.momentum_buffer
        joined = None
        if self.rank == 0:  # theta, then the momentum, each rank's shard in its place
            joined = self._buffer("state_buffer", self.numel * (1 if buf is None else 2))
        theta = moves.gather(self.theta_global, out=_part(joined, 0, self.numel))
        momentum = None if buf is None else moves.gather(
            buf, out=_part(joined, self.numel, self.numel))
        publish = getattr(self._averager, "publish_state", None) if self.rank == 0 else None
        if publish is None:
            return
        try:
            publish(shared.round_id, theta, momentum)
        except Exception as exc:  # catching up is best effort; training goes on
            log.warning("outer round %d: could not publish the global state: %s",
                        shared.round_id, exc)

    def _read_shard(self) -> torch.Tensor:
        """This rank's shard of theta_local (the parameters' fp32 master)."""
        return self._io.read_range(self.shard.lo, self.shard.hi)

    def _write(self, part: torch.Tensor) -> None:
        """Every rank's ``part`` (its shard) joined and written into the parameters, a run of
        parameters at a time (``ParamIO.write_joined``)."""
        moves = self._cluster.moves
        self._io.write_joined(lambda lo, hi: moves.all_gather_range(part, lo, hi))

    # --- exchange: rank 0 talks to the averager, the cluster gets the result by broadcast ----

    def _delta(self, local: torch.Tensor, *, keep_local: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's delta (theta_global - ``local``, its shard; made in ``local``'s memory
        unless ``keep_local``) and, on rank 0, the cluster's whole delta: every rank's joined in
        the averager's contribution memory when it lends some (the relay client's staging, sent
        without a copy), rank 0's own computed in its place there. None on the other ranks."""
        whole = self._buffer("contribution_buffer", self.numel) if self.rank == 0 else None
        if whole is not None:
            delta = torch.sub(self.theta_global, local, out=self.shard.of(whole))
        elif keep_local:
            delta = self.theta_global - local
        else:
            delta = local.neg_().add_(self.theta_global)
        return delta, self._cluster.moves.gather(delta, out=whole)

    def _buffer(self, kind: str, numel: int) -> torch.Tensor | None:
        """Memory rank 0's averager lends for a tensor it sends (``contribution_buffer``,
        ``state_buffer``), else new memory (None: what the shard moves make)."""
        try:  # (an averager that cannot be made fails in the exchange, on every rank)
            lend = getattr(self._get_averager(), kind, None)
            return lend(numel) if lend is not None else None
        except Exception as exc:  # noqa: BLE001 (plain memory then)
            log.warning("no memory lent by the averager for %s: %s", kind, exc)
            return None

    def _exchange(self, round_id: int, whole: torch.Tensor | None,
                  info: dict[str, float] | None = None) -> Shared:
        """Rank 0 hands the cluster's ``whole`` contribution to the averager (None on the other
        ranks); every rank gets the round's outcome."""
        result = error = None
        if self.rank == 0:
            try:
                result = self._get_averager().allreduce(round_id, whole.contiguous(), info)
            except Exception as exc:  # every rank must leave the broadcast, then raise
                error = exc
        del whole  # (rank 0 holds the round's average next, not both)
        return self._cluster.share(round_id, result, error, self._publishes())

    def _publishes(self) -> bool:
        """On rank 0: whether its averager takes the global state after a round."""
        return self.rank == 0 and hasattr(self._averager, "publish_state")

    def _finish_pending(self) -> Shared:
        out = self._inflight.finish(wait=self.round_timeout + 60.0)
        if out.arrive_s is not None and self.overlap_steps is None:  # told with the next round
            self.cadence.note_arrival(out.arrive_s)
        return self._cluster.share(out.round_id, out.result, out.error, self._publishes())

    # --- helpers --------------------------------------------------------------------------

    def _get_averager(self) -> Averager:
        if self._averager is None:
            self._averager = relay_client(self.config, [full_shape(p) for p in self._params])
        return self._averager

    @property
    def inner_steps(self) -> int:
        """H now: steps between rounds (``inner_steps: auto``: the last round's choice)."""
        return self.cadence.inner_steps

    def _samples_per_step(self) -> int:
        size = getattr(self.engine, "train_batch_size", None)
        value = size() if callable(size) else size
        return value if isinstance(value, int) and value > 0 else 1

    def _optimizer_steps(self) -> int:
        steps = getattr(self.engine, "global_steps", None)
        return int(steps) if isinstance(steps, int) else self._calls

    def _check_open(self) -> None:
        if self._closed:
            raise SyncError("this OuterSync is closed")


def _part(whole: torch.Tensor | None, lo: int, n: int) -> torch.Tensor | None:
    """``whole[lo:lo + n]`` (None for None)."""
    return None if whole is None else whole.narrow(0, lo, n)
