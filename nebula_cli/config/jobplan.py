"""From a JobSpec to a typed, frozen JobPlan: which host runs which agent, with which processes,
ranks, environment and files (the relay's relay.json, the workers' sync.json, certificates).

`build_plan(spec, job_id, sites, ports, certs)` is one pure function: the spec says what is
wanted, `sites` what the transports report about each host (its nebula directory, the address
its peers use, where its services bind, its python, whether it sees this machine's files),
`ports` the ports found free, `certs` the job's PKI. Nothing patches the plan afterwards; the
control plane only carries it out. Every value in it comes from the spec's model, where the
defaults live.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from nebula_cli.config import strict
from nebula_cli.config.checkpoint_paths import (
    checkpoint_settings as checkpoint_settings,
)
from nebula_cli.config.metrics_plan import METRICS_FILE, metrics_config
from nebula_cli.config.parts import (
    METRICS_CONFIG_ENV,
    METRICS_FILE_ENV,
    RUNTIME_HOOK_DIR,
    SYNC_CONFIG_ENV,
    AgentConfig,
    CheckpointSettings,
    ProcessConfig,
    SyncConfig,
)
from nebula_cli.config.pipeline import device_id
from nebula_cli.config.plan_model import (
    WORKER,
    WORKER_RESTART_BACKOFF,
    AgentPlan,
    Certs,
    JobPlan,
    Ports,
    Site,
    agent_dir,
    base_env,
    cert_names,
    conn_of,
    job_root_of,
    lib_dir,
    tls_files,
)
from nebula_cli.config.relay_plan import auto_steps, relay_addr, relay_agents, relay_socket
from nebula_cli.config.spec import ClusterSpec, JobSpec
from nebula_cli.config.worlds import (
    interface_of,
    pipeline_env,
    rendezvous_hosts,
    site_key,
    world_env,
    world_of,
)


def runtime_hook_dir(site: Site, job_root: str) -> str:
    """Where the automatic hook's sitecustomize is on the host: in the package this machine
    runs (a host that shares our files), else in the uploaded copy under the job's lib."""
    if site.shares_files:
        return str(Path(__file__).resolve().parent.parent.joinpath(*RUNTIME_HOOK_DIR))
    return posixpath.join(lib_dir(job_root), "nebula_cli", *RUNTIME_HOOK_DIR)


def with_runtime_hook(env: dict[str, str], site: Site, job_root: str) -> dict[str, str]:
    """`env` with the automatic hook's directory first on PYTHONPATH (what was there kept)."""
    parts = [runtime_hook_dir(site, job_root)]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    return {**env, "PYTHONPATH": ":".join(parts)}


def build_plan(spec: JobSpec, job_id: str, *, sites: dict[str, Site], ports: Ports,
               certs: Certs | None) -> JobPlan:
    """The whole plan of a job (pure). `certs` is required when the spec has a relay."""
    relays = relay_agents(spec, job_id, sites, ports, certs)
    workers = _worker_agents(spec, job_id, sites, ports, certs)
    return JobPlan(job_id=job_id, agents=tuple(relays + workers))


def _worker_agents(spec: JobSpec, job_id: str, sites: dict[str, Site], ports: Ports,
                   certs: Certs | None) -> list[AgentPlan]:
    """One worker agent per host: `slots` processes each running `spec.run` in the workdir.

    Data parallel: one world per cluster, ranks in host order. Pipeline: one world over every
    cluster, ranks from the pipeline layout."""
    plans = []
    layout = spec.pipeline_layout()
    masters = {world: sites[site_key(c, h)].address
               for world, (c, h) in rendezvous_hosts(spec).items()}
    host_index = 0  # across the clusters: CROSS_RANK of a pipelined world
    for ci, cluster in enumerate(spec.clusters):
        rank = 0
        world = world_of(spec, cluster)
        for node_rank, host in enumerate(cluster.hosts):
            site = sites[site_key(cluster, host)]
            job_root = job_root_of(site, job_id)
            adir = agent_dir(job_root, cluster.name, host.host, WORKER)
            cwd = spec.workdir if site.shares_files else posixpath.join(job_root, "work")
            env = {**spec.env, **cluster.env, **base_env(site, job_root)}
            env.update(world_env(spec, job_id, ci, node_rank, ports.masters[world],
                                  masters[world], interface_of(cluster, host, site)))
            if layout is not None:
                env.update(pipeline_env(spec, layout.world_size, layout.num_stages),
                           CROSS_RANK=str(host_index))
            host_index += 1
            if spec.runtime.auto:
                env = with_runtime_hook(env, site, job_root)
            if spec.deepspeed is not None:
                env["NEBULA_DS_CONFIG"] = posixpath.join(job_root, "ds_config.json")
            files: dict[str, bytes] = {}
            if spec.relay is not None:
                assert certs is not None  # build_plan's contract
                sync = sync_config(spec, job_id, cluster, adir,
                                   relay_addr=relay_addr(spec, cluster, sites, ports),
                                   relay_socket=relay_socket(job_root, cluster, host),
                                   checkpoint=checkpoint_settings(spec, job_id, job_root,
                                                                  cluster, host))
                env[SYNC_CONFIG_ENV] = posixpath.join(adir, "sync.json")
                cert, key = certs.workers[site_key(cluster, host)]
                files = {"sync.json": strict.dumps(sync),
                         **dict(zip(cert_names(WORKER), (certs.ca, cert, key), strict=True))}
            sinks = metrics_config(spec, job_id, cluster, node_rank, adir)
            if sinks is not None:
                files[METRICS_FILE] = strict.dumps(sinks)
            processes = []
            for local_rank in range(host.slots):
                device = device_id(cluster.name, host.host, local_rank)
                proc_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(local_rank),
                            "NEBULA_DEVICE": device}
                if layout is not None:
                    stage, replica = layout.position(device)
                    proc_env.update(RANK=str(layout.rank_of(device)), NEBULA_STAGE=str(stage),
                                    NEBULA_REPLICA=str(replica))
                name = proc_env["RANK"]
                proc_env[METRICS_FILE_ENV] = posixpath.join(
                    adir, "metrics", f"rank{name}.jsonl")
                if sinks is not None and local_rank == 0:  # the cluster's writer
                    proc_env[METRICS_CONFIG_ENV] = posixpath.join(adir, METRICS_FILE)
                processes.append(ProcessConfig(
                    name=name, argv=["/bin/sh", "-c", spec.run], env=proc_env,
                    log=f"logs/rank{name}.log", metrics=f"metrics/rank{name}.jsonl"))
                rank += 1
            config = AgentConfig(
                job_id=job_id, cluster=cluster.name, host=host.host, role=WORKER, cwd=cwd,
                grace=spec.grace, max_restarts=spec.max_restarts
                if cluster.max_restarts is None else cluster.max_restarts,
                restart_backoff=WORKER_RESTART_BACKOFF, processes=processes)
            # a Slurm cluster's nodes share one file system: its first node uploads
            shared = cluster.scheduler == "slurm" and node_rank > 0
            uploads = {} if site.shares_files or shared else {spec.workdir: cwd}
            plans.append(AgentPlan(
                cluster=cluster.name, host=host.host, role=WORKER, node_rank=node_rank,
                slots=host.slots, conn=conn_of(site, job_root), job_root=job_root,
                config=config, files=files, uploads=uploads,
                tensorboard=sinks.tensorboard_dir if sinks is not None else None))
    return plans


def sync_config(spec: JobSpec, job_id: str, cluster: ClusterSpec, adir: str, *,
                relay_addr: str, checkpoint: CheckpointSettings | None,
                relay_socket: str | None = None) -> SyncConfig:
    """The runtime's part: how a worker of `cluster` reaches its relay (`relay_socket`: on the
    relay's own host, see `relay_socket()`) and runs the outer loop."""
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
