"""From a JobSpec to a typed, frozen JobPlan: which host runs which agent, with which processes,
ranks, environment and files (the relay's relay.json, the workers' sync.json, certificates).
What a cluster's workers run is its job role's (`config.roles`); the rest (worlds, ranks,
metrics, restarts, uploads) is the same for every role.

`build_plan(spec, job_id, sites, ports, certs)` is one pure function: the spec says what is
wanted, `sites` what the transports report about each host (its nebula directory, the address
its peers use, where its services bind, its python, whether it sees this machine's files),
`ports` the ports found free, `certs` the job's PKI. Nothing patches the plan afterwards; the
control plane only carries it out. Every value in it comes from the spec's model, where the
defaults live.
"""

from __future__ import annotations

import posixpath

from nebula_cli.config import strict
from nebula_cli.config.metrics_plan import METRICS_FILE, metrics_config
from nebula_cli.config.parts import (
    METRICS_CONFIG_ENV,
    METRICS_FILE_ENV,
    AgentConfig,
    ProcessConfig,
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
    conn_of,
    job_root_of,
)
from nebula_cli.config.relay_plan import relay_agents
from nebula_cli.config.roles.registry import role_of
from nebula_cli.config.roles.worker_host import WorkerHost
from nebula_cli.config.spec import JobSpec
from nebula_cli.config.worlds import (
    interface_of,
    pipeline_env,
    rendezvous_hosts,
    site_key,
    world_env,
    world_of,
)


def build_plan(spec: JobSpec, job_id: str, *, sites: dict[str, Site], ports: Ports,
               certs: Certs | None, world_secret: str = "") -> JobPlan:
    """The whole plan of a job (pure). `certs` is required when the spec has a relay;
    `world_secret` (drawn at launch; "": none, no world abort) goes to every worker agent
    (`AgentConfig.world_secret`)."""
    relays = relay_agents(spec, job_id, sites, ports, certs)
    workers = _worker_agents(spec, job_id, sites, ports, certs, world_secret)
    return JobPlan(job_id=job_id, agents=tuple(relays + workers))


def _worker_agents(spec: JobSpec, job_id: str, sites: dict[str, Site], ports: Ports,
                   certs: Certs | None, world_secret: str) -> list[AgentPlan]:
    """One worker agent per host: `slots` processes each running what its cluster's role
    runs (`config.roles`) in the workdir.

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
        role = role_of(cluster)
        for node_rank, host in enumerate(cluster.hosts):
            site = sites[site_key(cluster, host)]
            job_root = job_root_of(site, job_id)
            adir = agent_dir(job_root, cluster.name, host.host, WORKER)
            at = WorkerHost(spec=spec, job_id=job_id, cluster=cluster, host=host,
                            node_rank=node_rank, site=site, job_root=job_root, agent_dir=adir,
                            sites=sites, ports=ports, certs=certs)
            cwd = spec.workdir if site.shares_files else posixpath.join(job_root, "work")
            env = base_env(site, job_root, {**spec.env, **cluster.env})
            env.update(world_env(spec, job_id, ci, node_rank, ports.masters[world],
                                  masters[world], interface_of(cluster, host, site)))
            if layout is not None:
                env.update(pipeline_env(spec, layout.world_size, layout.num_stages),
                           CROSS_RANK=str(host_index))
            host_index += 1
            env = role.environment(at, env)
            if spec.deepspeed is not None:
                env["NEBULA_DS_CONFIG"] = posixpath.join(job_root, "ds_config.json")
            named, files = role.files(at)
            env.update(named)
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
                proc_env.update(cluster.scheduling.rank_env(cluster, int(proc_env["RANK"]),
                                                            local_rank))
                name = proc_env["RANK"]
                proc_env[METRICS_FILE_ENV] = posixpath.join(
                    adir, "metrics", f"rank{name}.jsonl")
                if sinks is not None and local_rank == 0:  # the cluster's writer
                    proc_env[METRICS_CONFIG_ENV] = posixpath.join(adir, METRICS_FILE)
                processes.append(ProcessConfig(
                    name=name, argv=role.command(at), env=proc_env,
                    log=f"logs/rank{name}.log", metrics=f"metrics/rank{name}.jsonl"))
                rank += 1
            config = AgentConfig(
                job_id=job_id, cluster=cluster.name, host=host.host, role=WORKER, cwd=cwd,
                grace=spec.grace, max_restarts=spec.max_restarts
                if cluster.max_restarts is None else cluster.max_restarts,
                restart_backoff=WORKER_RESTART_BACKOFF, processes=processes,
                rotation=spec.logs.rotation(), world_secret=world_secret)
            # nodes that share one file system (a Slurm cluster's): its first node uploads
            shared = cluster.scheduling.nodes_share_files and node_rank > 0
            uploads = {} if site.shares_files or shared else {spec.workdir: cwd}
            plans.append(AgentPlan(
                cluster=cluster.name, host=host.host, role=WORKER, node_rank=node_rank,
                slots=host.slots, conn=conn_of(site, job_root), job_root=job_root,
                config=config, files=files, uploads=uploads,
                tensorboard=sinks.tensorboard_dir if sinks is not None else None,
                files_from_first_host=shared))
    return plans
