"""Where each host keeps its checkpoints, and the runtime's checkpoint settings there.

Re-exported by `nebula_cli.config.jobplan`.
"""

from __future__ import annotations

import posixpath

from nebula_cli.config.parts import CheckpointSettings
from nebula_cli.config.spec import ClusterSpec, HostSpec, JobSpec


def checkpoint_dir(spec: JobSpec, job_id: str, job_root: str, cluster: ClusterSpec,
                   host: HostSpec | int) -> str | None:
    """Where one host keeps its checkpoints: `<job dir>/<checkpoint.dir>/<cluster>/<host>` (an
    absolute checkpoint.dir gets the job id after it, so that jobs never share checkpoints).
    One directory per cluster and host: hosts that share a filesystem never mix their shards.
    On a Slurm cluster `<host>` is `node<i>`, its place in the allocation: a resumed job's new
    allocation, on whichever nodes, finds them (its nodes share the file system)."""
    if spec.checkpoint is None:
        return None
    base = spec.checkpoint.dir
    root = posixpath.join(base, job_id) if posixpath.isabs(base) else posixpath.join(
        job_root, base)
    return posixpath.join(root, cluster.name, checkpoint_host(cluster, host))


def checkpoint_host(cluster: ClusterSpec, host: HostSpec | int) -> str:
    """A host's part of the checkpoint path, as its cluster's scheduler places it: its name,
    or on a Slurm cluster `node<i>` (`host` may be given as that index)."""
    return cluster.scheduling.checkpoint_host(cluster, host)


def checkpoint_settings(spec: JobSpec, job_id: str, job_root: str, cluster: ClusterSpec,
                        host: HostSpec) -> CheckpointSettings | None:
    """The runtime's checkpoint settings on one host, or None without `checkpoint:`."""
    where = checkpoint_dir(spec, job_id, job_root, cluster, host)
    if spec.checkpoint is None or where is None:
        return None
    return CheckpointSettings(dir=where, every=spec.checkpoint.every, keep=spec.checkpoint.keep)


