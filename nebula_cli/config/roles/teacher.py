"""`TeacherRole` (`teacher`): the cluster serves soft labels to the training clusters. Its
processes run the cluster's own `run` (a script calling `nebula_cli.runtime.distill.serve`)
or the built-in server of a Hugging Face causal LM (`teacher: {model: ...}`), without the
training hook; each host's processes get distill.json and their certificates. The cluster
takes no part in the averaging: its relay service is the soft labels'."""

from __future__ import annotations

import posixpath

from nebula_cli.config import strict
from nebula_cli.config.distill_config import (
    DISTILL_CONFIG_ENV,
    TEACHER_CHECKPOINT_DIR,
    TEACHER_CHECKPOINT_ENV,
)
from nebula_cli.config.distill_plan import distill_config
from nebula_cli.config.parts import METRICS_CONFIG_ENV, METRICS_FILE_ENV, helper_env
from nebula_cli.config.plan_model import WORKER, cert_names
from nebula_cli.config.roles.kind import RoleKind
from nebula_cli.config.roles.worker_host import WorkerHost
from nebula_cli.config.worlds import site_key

DISTILL_FILE = "distill.json"
BUILTIN_SERVER = "nebula_cli.runtime.distill.hf_server"
"""The module the built-in server runs as (`python -m`)."""


class TeacherRole:
    """Teacher processes: one serving rank per slot, answering the students' label requests."""

    kind = RoleKind.TEACHER
    name = kind.value
    relay_services = kind.relay_services
    trains = kind.trains

    def command(self, at: WorkerHost) -> list[str]:
        if at.cluster.run is not None:
            return ["/bin/sh", "-c", at.cluster.run]
        return [at.site.python, "-m", BUILTIN_SERVER]

    def environment(self, at: WorkerHost, env: dict[str, str]) -> dict[str, str]:
        """Without the training hook (a teacher does not train); its metric files kept; a
        teacher serving a checkpoint is told where it is (`TEACHER_CHECKPOINT_ENV`)."""
        kept = {k: env[k] for k in (METRICS_FILE_ENV, METRICS_CONFIG_ENV) if k in env}
        teacher = at.cluster.teacher
        if teacher is not None and teacher.from_job:
            kept[TEACHER_CHECKPOINT_ENV] = posixpath.join(at.job_root, TEACHER_CHECKPOINT_DIR)
        elif teacher is not None and teacher.checkpoint:
            kept[TEACHER_CHECKPOINT_ENV] = teacher.checkpoint  # (relative: to its workdir)
        return helper_env(env) | kept

    def files(self, at: WorkerHost) -> tuple[dict[str, str], dict[str, bytes]]:
        """distill.json (`DISTILL_CONFIG_ENV` names it) and the workers' PEM files."""
        return distill_files(at)


def distill_files(at: WorkerHost) -> tuple[dict[str, str], dict[str, bytes]]:
    """A cluster's distill.json and its workers' PEM files (teachers and students alike)."""
    assert at.certs is not None  # a teacher needs a relay: the spec's checks
    cfg = distill_config(at.spec, at.job_id, at.cluster, at.agent_dir, at.sites,
                         at.ports)
    cert, key = at.certs.workers[site_key(at.cluster, at.host)]
    files = {DISTILL_FILE: strict.dumps(cfg),
             **dict(zip(cert_names(WORKER), (at.certs.ca, cert, key), strict=True))}
    return {DISTILL_CONFIG_ENV: posixpath.join(at.agent_dir, DISTILL_FILE)}, files
