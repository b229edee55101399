"""Job roles (`config.roles`): every cluster trains; the `train` role's processes, files and
relay services, as the plan builds every worker agent through it."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
from helpers.plan_defaults import MINIMAL

from nebula_cli.config import jobplan, plan_model, worlds
from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV, DistillConfig
from nebula_cli.config.parts import (
    METRICS_FILE_ENV,
    RUNTIME_HOOK_DIR,
    SYNC_CONFIG_ENV,
    SyncConfig,
)
from nebula_cli.config.roles.kind import ROLE_NAMES, RoleKind
from nebula_cli.config.roles.registry import (
    DEFAULT_ROLE,
    ROLES,
    role_named,
    role_of,
    serving_clusters,
)
from nebula_cli.config.roles.services import RelayService
from nebula_cli.config.roles.teacher import BUILTIN_SERVER, TeacherRole
from nebula_cli.config.roles.train import TrainRole
from nebula_cli.config.roles.worker_host import WorkerHost
from nebula_cli.config.spec import ClusterSpec, JobSpec, parse_spec
from nebula_cli.errors import UsageError
from nebula_cli.transport.ssh.conn import SshConn


def spec_of(extra: str = "", relay: bool = True) -> JobSpec:
    text = MINIMAL.replace("relay: {}\n", "relay: {}\n" if relay else "") + extra
    return parse_spec(text, base_dir=Path(__file__).parent)


def site() -> plan_model.Site:
    return plan_model.Site(conn=SshConn(name="e1", python="python3"), home="/home/u/.nebula",
                           address="e1.example", bind="0.0.0.0", python="python3",
                           shares_files=False)


def at(spec: JobSpec) -> WorkerHost:
    cluster = spec.clusters[0]
    sites = {worlds.site_key(c, h): site() for c in spec.clusters for h in c.hosts}
    certs = plan_model.Certs(ca=b"CA", relays={c.name: (b"c", b"k") for c in spec.clusters},
                             workers={k: (b"wc", b"wk") for k in sites})
    return WorkerHost(spec=spec, job_id="j", cluster=cluster, host=cluster.hosts[0],
                      node_rank=0, site=site(), job_root="/home/u/.nebula/jobs/j",
                      agent_dir="/home/u/.nebula/jobs/j/east/e1/worker", sites=sites,
                      ports=plan_model.Ports(masters={"east": 1, "west": 2},
                                             relays={"east": (29400, 29401),
                                                     "west": (29400, 29401)},
                                             labels={"east": 29402}),
                      certs=certs)


def test_every_cluster_trains_and_an_unknown_role_names_the_roles() -> None:
    assert set(ROLES) == {"train", "teacher"} and DEFAULT_ROLE in ROLES
    assert all(isinstance(role_of(c), TrainRole) for c in spec_of().clusters)
    with pytest.raises(UsageError, match="unknown job role 'student'; the roles are: teacher, "
                                         "train"):
        role_named("student")


def test_a_teacher_serves_the_training_and_a_recorded_spec_names_its_clusters() -> None:
    assert TrainRole().trains and not TeacherRole().trains
    spec = teacher_spec().model_dump(mode="json")  # as the state store keeps it
    assert serving_clusters(spec) == {"east"}
    assert serving_clusters(spec_of().model_dump(mode="json")) == frozenset()
    assert serving_clusters({"clusters": [{"name": "old"}]}) == frozenset()  # no role: train


def test_the_specs_role_names_are_the_registrys() -> None:
    role_field = ClusterSpec.model_fields["role"].annotation
    assert set(typing.get_args(role_field)) == set(ROLES)
    assert ClusterSpec.model_fields["role"].default == DEFAULT_ROLE


def test_a_cluster_averages_when_its_role_takes_part_in_the_averaging() -> None:
    spec = teacher_spec()
    for cluster in spec.clusters:
        assert cluster.averages == (RelayService.AVERAGE in role_of(cluster).relay_services)
    assert [c.averages for c in spec.clusters] == [False, True]


TEACHER = """distill: {topk: 8}
""", ("  - {name: east, transport: local, hosts: [e1]}",
      "  - {name: east, transport: local, hosts: [e1], role: teacher, run: python serve.py}")


def teacher_spec(run: bool = True) -> JobSpec:
    extra, (old, new) = TEACHER
    text = MINIMAL.replace(old, new if run else new.replace(", run: python serve.py",
                                                            ", teacher: {model: m}"))
    return parse_spec(text + extra, base_dir=Path(__file__).parent)


def test_a_teacher_serves_soft_labels_with_its_own_run_and_no_training_hook() -> None:
    spec = teacher_spec()
    role, here = role_of(spec.clusters[0]), at(spec)
    assert isinstance(role, TeacherRole)
    assert role.relay_services == frozenset({RelayService.SOFT_LABELS})
    assert role.command(here) == ["/bin/sh", "-c", "python serve.py"]
    env = role.environment(here, {"PYTHONPATH": f"/x/{'/'.join(RUNTIME_HOOK_DIR)}:/lib",
                                  METRICS_FILE_ENV: "m.jsonl"})
    assert env == {"PYTHONPATH": "/lib", METRICS_FILE_ENV: "m.jsonl"}
    builtin = teacher_spec(run=False)
    assert role.command(at(builtin)) == ["python3", "-m", BUILTIN_SERVER]


def test_teacher_and_students_get_distill_json(tmp_path: Path) -> None:
    spec = teacher_spec()
    here = at(spec)
    named, files = TeacherRole().files(here)
    assert named == {DISTILL_CONFIG_ENV: f"{here.agent_dir}/distill.json"}
    assert set(files) == {"distill.json", *plan_model.cert_names(plan_model.WORKER)}
    (tmp_path / "t.json").write_bytes(files["distill.json"])
    cfg = DistillConfig.load(tmp_path / "t.json")
    assert cfg.teacher and cfg.students == {"west": 1} and cfg.topk == 8
    student = dataclasses.replace(here, cluster=spec.clusters[1], host=spec.clusters[1].hosts[0])
    named, files = TrainRole().files(student)
    assert set(named) == {DISTILL_CONFIG_ENV, SYNC_CONFIG_ENV}
    (tmp_path / "s.json").write_bytes(files["distill.json"])
    cfg = DistillConfig.load(tmp_path / "s.json")
    assert not cfg.teacher and list(cfg.teachers) == ["east"] and cfg.cluster == "west"


def test_training_clusters_take_part_in_the_averaging() -> None:
    assert TrainRole().relay_services == frozenset({RelayService.AVERAGE})


def test_train_runs_the_specs_command_through_the_hook_when_asked() -> None:
    role, here = TrainRole(), at(spec_of())
    assert role.command(here) == ["/bin/sh", "-c", "python train.py"]
    hooked = role.environment(here, {"PYTHONPATH": "/lib"})
    assert hooked["PYTHONPATH"].endswith(":/lib") and "autohook" in hooked["PYTHONPATH"]
    plain = at(spec_of("runtime: {auto: false}\n"))
    assert role.environment(plain, {"PYTHONPATH": "/lib"}) == {"PYTHONPATH": "/lib"}


def test_with_a_relay_its_workers_get_sync_json_and_their_certificates(tmp_path: Path) -> None:
    here = at(spec_of())
    named, files = TrainRole().files(here)
    assert named == {SYNC_CONFIG_ENV: f"{here.agent_dir}/sync.json"}
    assert set(files) == {"sync.json", *plan_model.cert_names(plan_model.WORKER)}
    assert files["certs/worker.pem"] == b"wc" and files["certs/ca.pem"] == b"CA"
    (tmp_path / "sync.json").write_bytes(files["sync.json"])
    sync = SyncConfig.load(tmp_path / "sync.json")  # what the runtime loads, strictly
    assert sync.cluster == "east" and sync.relay_addr == "e1.example:29401"
    assert TrainRole().files(at(spec_of(relay=False))) == ({}, {})


def test_the_plan_builds_every_worker_through_its_role() -> None:
    spec = spec_of()
    sites = {worlds.site_key(c, h): dataclasses.replace(site(), address=f"{h.host}.example")
             for c in spec.clusters for h in c.hosts}
    here = dataclasses.replace(at(spec), sites=sites)
    plan = jobplan.build_plan(spec, "j", sites=sites, ports=here.ports, certs=here.certs)
    for worker in plan.hosts:
        (proc,) = worker.config.processes
        assert proc.argv == TrainRole().command(here)
        sync = json.loads(worker.files["sync.json"])
        assert proc.env[SYNC_CONFIG_ENV] == f"{worker.agent_dir}/sync.json"
        assert sync["cluster"] == worker.cluster


def test_a_role_is_asked_what_it_does_by_its_kind() -> None:
    assert [k.value for k in RoleKind] == list(ROLE_NAMES) == ["train", "teacher"]
    assert set(ROLE_NAMES) == set(ROLES)
    assert (RoleKind.TRAIN.averages, RoleKind.TRAIN.serves_labels, RoleKind.TRAIN.trains) == (
        True, False, True)
    assert (RoleKind.TEACHER.averages, RoleKind.TEACHER.serves_labels,
            RoleKind.TEACHER.trains) == (False, True, False)
    for role in ROLES.values():  # each JobRole takes what it does from its kind
        assert role.name == role.kind.value
        assert (role.relay_services, role.trains) == (role.kind.relay_services, role.kind.trains)
    spec = teacher_spec()
    assert [c.kind for c in spec.clusters] == [RoleKind.TEACHER, RoleKind.TRAIN]
    assert [c.kind.serves_labels for c in spec.clusters] == [True, False]
