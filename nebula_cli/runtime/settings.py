"""Where the worker runtime's settings come from: whether this process should sync at all
(``wanted``), its part of the job plan (``plan_config``: the sync.json named by
$NEBULA_SYNC_CONFIG), what the relay is told this cluster syncs (``sync_layout``), and the
client that reaches the relay (``relay_client``)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from nebula_cli.config.parts import SYNC_CONFIG_ENV, SyncConfig
from nebula_cli.errors import NebulaError
from nebula_cli.runtime.metrics import DRY_RUN_ENV
from nebula_cli.runtime.outer import SyncError

LAYOUT_BYTES = 16 * 1024
"""Largest per-tensor layout told to the relay; a bigger one is told as one flat vector."""


def wanted() -> bool:
    """Whether this process should wrap its engine in an OuterSync: the job's plan gave it a
    sync config ($NEBULA_SYNC_CONFIG), or it runs in `nebula plan`'s dry run ($NEBULA_DRY_RUN)."""
    return bool(os.environ.get(SYNC_CONFIG_ENV) or os.environ.get(DRY_RUN_ENV))


def sync_layout(shapes: list[torch.Size]) -> dict[str, list[Any]]:
    """What the relay is told this cluster syncs: the tensors' shapes (one flat fp32 vector
    when the list would not fit in a small HELLO)."""
    layout: dict[str, list[Any]] = {"shapes": [list(s) for s in shapes],
                                     "dtypes": ["float32"] * len(shapes)}
    if len(json.dumps(layout)) > LAYOUT_BYTES:
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        layout = {"shapes": [[numel]], "dtypes": ["float32"]}
    return layout


def plan_config() -> SyncConfig | None:
    """This worker's part of the job plan (sync.json named by $NEBULA_SYNC_CONFIG), if any."""
    path = os.environ.get(SYNC_CONFIG_ENV)
    if not path:
        return None
    try:
        return SyncConfig.load(path)
    except NebulaError as exc:
        raise SyncError(f"cannot use the sync config: {exc}") from exc


def relay_client(cfg: SyncConfig | None, shapes: list[torch.Size]) -> Any:
    """The averager of rank 0: a RelayClient to the relay the plan names, through its Unix
    socket when the plan names one for this host (SyncError without a plan)."""
    if cfg is None:
        raise SyncError(f"no relay to average with: ${SYNC_CONFIG_ENV} is not set "
                        f"(run under `nebula launch` with a relay, or pass averager=)")
    from nebula_cli.relay.process.client import RelayClient

    return RelayClient(
        cfg.relay_addr, ca=cfg.tls.ca, cert=cfg.tls.cert, key=cfg.tls.key,
        job_id=cfg.job_id, cluster=cfg.cluster, round_timeout=cfg.round_timeout,
        layout=sync_layout(shapes), local=cfg.relay_socket)


def outer_by_codec(config: SyncConfig | None) -> dict[str, tuple[float, float]]:
    """(outer lr, momentum) of a round by the codec it used (``compression: auto``)."""
    if config is None:
        return {}
    return {c: (float(v[0]), float(v[1])) for c, v in config.outer_by_codec.items()}


def resolve_settings(given: dict[str, Any], overlap_steps: int | None,
                     config: SyncConfig | None) -> dict[str, Any]:
    """OuterSync's settings: each from its argument, else from the plan's sync config (the
    spec's); SyncError when neither has it."""
    out = {}
    for name, value in given.items():
        if value is None:
            if config is None:
                raise SyncError(
                    f"{name} was not given and there is no sync config "
                    f"(${SYNC_CONFIG_ENV}): OuterSync takes its settings from the job's "
                    f"plan under `nebula launch`, or from config=SyncConfig(...)")
            value = getattr(config, name)
        out[name] = value
    out["overlap_steps"] = overlap_steps if overlap_steps is not None else (
        config.overlap_steps if config else None)
    return out
