"""Reading and writing the synced parameters as one flat fp32 vector, through whichever fp32
master copy the DeepSpeed engine keeps (ZeRO 0 fp32 directly; FP16_Optimizer's master copy;
ZeRO 1/2 partitions; ZeRO 3 through safe_get/set_full_fp32_param). See TESTBED.md: writing
`param.data` alone is silently overwritten on the next step under ZeRO 1-3."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nebula_cli.runtime.host_transfer import HostStage
from nebula_cli.runtime.outer import SyncError

WRITE_CHUNK = 1 << 24
"""Elements of the vector joined at a time when the ranks write their shards into the
parameters (``ParamIO.write_joined``): 64 MiB, or one larger parameter."""


class ParamIO:
    """Reads/writes the synced parameters as one flat fp32 CPU vector (all ranks call both)."""

    collective_read = False
    """Whether reading one parameter is a collective (then every rank reads every one)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.shapes = [full_shape(p) for p in params]
        self.numels = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.numels)
        self.stage = HostStage()  # accelerator <-> host copies through pinned chunks

    def read(self) -> torch.Tensor:
        parts = [self._read_one(i, p) for i, p in enumerate(self.params)]
        if not parts:
            return torch.zeros(0, dtype=torch.float32)
        if any(t.is_cuda for t in parts):
            return self.stage.gather(parts, self.numel)
        return torch.cat([t.detach().to("cpu", torch.float32).reshape(-1) for t in parts])

    def read_range(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flat vector, as a new fp32 CPU tensor of that length
        (a rank's shard, runtime/shard.py): only the parameters it touches are copied."""
        out = torch.empty(hi - lo, dtype=torch.float32)
        offset = 0
        for i, (p, n) in enumerate(zip(self.params, self.numels, strict=True)):
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b or self.collective_read:
                value = self._read_one(i, p)
                if a < b:
                    out.narrow(0, a - lo, b - a).copy_(
                        value.detach().reshape(-1).narrow(0, a - offset, b - a))
            offset += n
        return out

    def write_joined(self, join: Callable[[int, int], torch.Tensor],
                     chunk: int = WRITE_CHUNK) -> None:
        """Write the vector whose elements ``[lo, hi)`` ``join(lo, hi)`` returns, a run of
        consecutive parameters at a time (at most ``chunk`` elements, or one larger parameter):
        no whole vector is built. Every rank calls it; ``join`` is a collective."""
        i, offset = 0, 0
        while i < len(self.params):
            j, end = i + 1, offset + self.numels[i]
            while j < len(self.params) and end + self.numels[j] - offset <= chunk:
                end += self.numels[j]
                j += 1
            values, at = join(offset, end), 0
            for k in range(i, j):
                self._write_one(k, self.params[k],
                                values.narrow(0, at, self.numels[k]).view(self.shapes[k]))
                at += self.numels[k]
            i, offset = j, end

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


class _DirectIO(ParamIO):
    """fp32 parameters and no master copy (ZeRO 0, fp32): ``p.data`` is the master."""

    def _read_one(self, i: int, p: torch.nn.Parameter) -> torch.Tensor:
        return p.data

    def _write_one(self, i: int, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        p.data.copy_(self.stage.upload(value, p.device))


class _MasterCopyIO(ParamIO):
    """ZeRO 0 with bf16/fp16: the fp32 master lives in DeepSpeed's FP16_(Unfused)Optimizer."""

    def __init__(self, params: list[torch.nn.Parameter], masters: list[torch.Tensor]) -> None:
        super().__init__(params)
        self.masters = masters

    def _read_one(self, i: int, p: torch.nn.Parameter) -> torch.Tensor:
        return self.masters[i]

    def _write_one(self, i: int, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        value = self.stage.upload(value, self.masters[i].device)
        self.masters[i].copy_(value)
        p.data.copy_(value)


class _ZeroIO(ParamIO):
    """ZeRO 1/2 (and DeepSpeed's BF16_Optimizer): fp32 master partitions behind ``_hp_mapping``.

    ``safe_get_full_fp32_param`` is a collective over the data-parallel group.
    """

    collective_read = True

    def _read_one(self, i: int, p: torch.nn.Parameter) -> torch.Tensor:
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(p)

    def _write_one(self, i: int, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        value = self.stage.upload(value, p.device)
        safe_set_full_fp32_param(p, value)
        p.data.copy_(value)  # the low-precision copy the next forward uses


class _Zero3IO(_ZeroIO):
    """ZeRO 3: fp32 master partitions, and partitioned parameters rewritten while gathered."""

    def __init__(self, params: list[torch.nn.Parameter], rank: int) -> None:
        super().__init__(params)
        self.rank = rank

    def write_joined(self, join: Callable[[int, int], torch.Tensor],
                     chunk: int = WRITE_CHUNK) -> None:
        """ZeRO 3 rewrites every parameter inside one gather: the whole vector is joined."""
        self.write(join(0, self.numel))

    def write(self, flat: torch.Tensor) -> None:
        from deepspeed.runtime.zero import GatheredParameters

        values = list(self._split(flat))
        for p, value in zip(self.params, values, strict=True):
            _set_zero3_fp32(p, self.stage.upload(value, p.ds_tensor.device))
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


def full_shape(p: torch.nn.Parameter) -> torch.Size:
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


def zero_stage(engine: Any) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else 0


def make_io(engine: Any, params: list[torch.nn.Parameter], rank: int) -> ParamIO:
    stage = zero_stage(engine)
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


def check_gradient_mode(engine: Any) -> None:
    """SyncError unless per-step gradient sync works with this engine (ZeRO 0, no fp16, DeepSpeed's
    managed gradient accumulation)."""
    stage = zero_stage(engine)
    if stage != 0:
        raise SyncError(f"gradient mode supports ZeRO stage 0 only (this engine: stage "
                        f"{stage}); use DiLoCo mode with ZeRO")
    if hasattr(engine, "fp16_enabled") and engine.fp16_enabled():
        raise SyncError("gradient mode does not support fp16 (loss-scaled gradients differ "
                        "between clusters); use bf16 or fp32")
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if callable(managed) and not managed():
        raise SyncError("gradient mode needs DeepSpeed's managed gradient accumulation")
