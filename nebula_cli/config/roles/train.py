"""`TrainRole` (`train`): the cluster runs the spec's `run` on every slot, through the
automatic runtime hook when `runtime.auto` is on, and (with a relay) averages with the other
training clusters: each host's workers get sync.json and their certificates."""

from __future__ import annotations

import posixpath

from nebula_cli.config import strict
from nebula_cli.config.checkpoint_paths import checkpoint_settings
from nebula_cli.config.parts import SYNC_CONFIG_ENV
from nebula_cli.config.plan_model import WORKER, cert_names
from nebula_cli.config.relay_plan import relay_addr, relay_socket
from nebula_cli.config.roles.kind import RoleKind
from nebula_cli.config.roles.teacher import distill_files
from nebula_cli.config.roles.worker_host import WorkerHost
from nebula_cli.config.runtime_hook import with_runtime_hook
from nebula_cli.config.sync_plan import sync_config
from nebula_cli.config.worlds import site_key

SYNC_FILE = "sync.json"


class TrainRole:
    """Training workers: DeepSpeed ranks running the spec's script, synced by the relays."""

    kind = RoleKind.TRAIN
    name = kind.value
    relay_services = kind.relay_services
    trains = kind.trains

    def command(self, at: WorkerHost) -> list[str]:
        return ["/bin/sh", "-c", at.cluster.run or at.spec.run]

    def environment(self, at: WorkerHost, env: dict[str, str]) -> dict[str, str]:
        return with_runtime_hook(env, at.site, at.job_root) if at.spec.runtime.auto else env

    def files(self, at: WorkerHost) -> tuple[dict[str, str], dict[str, bytes]]:
        """With a relay: sync.json (`SYNC_CONFIG_ENV` names it) and the workers' PEM files;
        with `distill:` also distill.json (a student's)."""
        spec, cluster, host = at.spec, at.cluster, at.host
        if spec.relay is None:
            return {}, {}
        named, files = distill_files(at) if spec.distill is not None else ({}, {})
        assert at.certs is not None  # build_plan's contract
        sync = sync_config(spec, at.job_id, cluster, at.agent_dir,
                           relay_addr=relay_addr(spec, cluster, at.sites, at.ports),
                           relay_socket=relay_socket(at.job_root, cluster, host),
                           checkpoint=checkpoint_settings(spec, at.job_id, at.job_root,
                                                          cluster, host))
        cert, key = at.certs.workers[site_key(cluster, host)]
        files |= {SYNC_FILE: strict.dumps(sync),
                  **dict(zip(cert_names(WORKER), (at.certs.ca, cert, key), strict=True))}
        return named | {SYNC_CONFIG_ENV: posixpath.join(at.agent_dir, SYNC_FILE)}, files
