"""A cluster's `DistillConfig` from the spec: where the teachers' label relays listen, who may
ask them, and the `distill:` settings."""

from __future__ import annotations

from nebula_cli.config.distill_config import DistillConfig
from nebula_cli.config.plan_model import WORKER, Ports, Site, tls_files
from nebula_cli.config.relay_plan import dial_address
from nebula_cli.config.spec import ClusterSpec, JobSpec
from nebula_cli.config.worlds import site_key


def labels_port(spec: JobSpec) -> int:
    """The port a teacher cluster's label relay prefers (`distill.port`, default the relay's
    port + 2: beside its peer and worker ports); where hosts share a machine (the local
    transport) the plan takes a free one instead (`Ports.labels`), as for the relays."""
    assert spec.relay is not None and spec.distill is not None  # the spec's checks
    return spec.distill.port or spec.relay.port + 2


def distill_config(spec: JobSpec, job_id: str, cluster: ClusterSpec, adir: str,
                   sites: dict[str, Site], ports: Ports) -> DistillConfig:
    """`cluster`'s distill.json (the job has `distill:`); `adir`: the worker agent's folder.
    A teacher's label relay is dialled where the averaging relays dial a cluster's relay
    (`relay_plan.dial_address`: what its gateway's transport reported), on its planned port."""
    assert spec.distill is not None and spec.relay is not None
    d = spec.distill
    teachers = [c for c in spec.clusters if c.kind.serves_labels]
    is_teacher = cluster.kind.serves_labels
    gateway = sites[site_key(cluster, cluster.gateway_host)]
    return DistillConfig(
        job_id=job_id, cluster=cluster.name, teacher=is_teacher,
        listen=f"{gateway.bind}:{ports.labels[cluster.name]}" if is_teacher else "",
        teachers={c.name: f"{dial_address(c, sites)}:{ports.labels[c.name]}"
                  for c in teachers},
        students={c.name: sum(h.slots for h in c.hosts) for c in spec.clusters
                  if not c.kind.serves_labels},
        tls=tls_files(adir, WORKER), topk=d.wire_topk, temperature=d.temperature, alpha=d.alpha,
        lookahead=d.lookahead, when_no_teacher=d.when_no_teacher,
        values=d.wire_values,
        max_tokens=d.max_tokens, vocab=d.vocab, wait_s=d.wait_s,
        dead_after=spec.relay.dead_after,
        model=cluster.teacher.model if cluster.teacher else None,
        hub=cluster.teacher.hub if cluster.teacher else False,
        batch_tokens=cluster.teacher.batch_tokens if cluster.teacher else None)
