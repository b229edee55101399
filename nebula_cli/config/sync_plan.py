"""The runtime's part of a training worker: its `SyncConfig` (sync.json), how it reaches its
cluster's relay and runs the outer loop. Written by the `train` role (`config.roles.train`)."""

from __future__ import annotations

from nebula_cli.config.parts import CheckpointSettings, SyncConfig
from nebula_cli.config.plan_model import WORKER, tls_files
from nebula_cli.config.relay_plan import auto_steps
from nebula_cli.config.spec import ClusterSpec, JobSpec


def sync_config(spec: JobSpec, job_id: str, cluster: ClusterSpec, adir: str, *,
                relay_addr: str, checkpoint: CheckpointSettings | None,
                relay_socket: str | None = None) -> SyncConfig:
    """The runtime's part: how a worker of `cluster` reaches its relay (`relay_socket`: on the
    relay's own host, see `relay_plan.relay_socket()`) and runs the outer loop."""
    relay = spec.relay
    assert relay is not None  # only for a spec with a relay
    sync, comp = relay.sync, relay.compression
    first_lr, first_momentum = relay.outer_for(comp.codecs[0])
    return SyncConfig(
        job_id=job_id, cluster=cluster.name, relay_addr=relay_addr, relay_socket=relay_socket,
        tls=tls_files(adir, WORKER), mode=sync.mode, inner_steps=sync.first_inner_steps,
        every_s=sync.every, auto_steps=auto_steps(spec),
        outer_lr=first_lr, outer_momentum=first_momentum,
        outer_by_codec={c: list(relay.outer_for(c)) for c in comp.codecs},
        nesterov=sync.nesterov, overlap=sync.overlap,
        overlap_steps=sync.overlap_steps, codec=comp.codec,
        error_feedback=comp.error_feedback, round_timeout=relay.timeout, checkpoint=checkpoint)
