"""The metrics sinks' part of the plan: which process writes a cluster's TensorBoard and W&B
runs (the first rank of the cluster's first host) and where, on that host (spec: metrics).

Used by `nebula_cli.config.jobplan`.
"""

from __future__ import annotations

import posixpath

from nebula_cli.config.parts import MetricsConfig, WandbSettings
from nebula_cli.config.spec import ClusterSpec, JobSpec

METRICS_FILE = "metrics.json"
"""The part's file, beside agent.json of the writer's host."""
TENSORBOARD_DIR = "tb"
"""The cluster's TensorBoard run, in the writer's agent directory."""


def metrics_config(spec: JobSpec, job_id: str, cluster: ClusterSpec, node_rank: int,
                   adir: str) -> MetricsConfig | None:
    """The sinks of the host at `node_rank` of `cluster` (agent directory `adir`): only the
    cluster's first host has them, and only when the spec asks for a sink."""
    metrics = spec.metrics
    if node_rank != 0 or not (metrics.tensorboard or metrics.wandb):
        return None
    wandb = None
    if metrics.wandb is not None:
        wandb = WandbSettings(project=metrics.wandb.project, mode=metrics.wandb.mode,
                              entity=metrics.wandb.entity, name=cluster.name, group=job_id,
                              dir=adir)
    return MetricsConfig(
        job_id=job_id, cluster=cluster.name,
        tensorboard_dir=posixpath.join(adir, TENSORBOARD_DIR) if metrics.tensorboard else None,
        wandb=wandb)
