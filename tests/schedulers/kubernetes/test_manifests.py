"""A Kubernetes cluster's objects (schedulers/kubernetes/manifests.py) as data: valid against
the official OpenAPI schemas of two Kubernetes versions (kubernetes-validate, offline, strict:
no field the API does not know), the same as the golden files in golden/ (rewrite them with
NEBULA_UPDATE_GOLDEN=1 and read the diff), no key anywhere but the Secret, and a checkpoint
folder that would die with its pod refused."""

from __future__ import annotations

import base64
import dataclasses
import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from nebula_cli.schedulers.kubernetes.manifests import (
    INDEX_LABEL,
    NAME_MAX,
    PLACEHOLDER,
    ManifestError,
    PodLaunch,
    base_name,
    cluster_objects,
    file_name,
    secret_names,
    write,
)
from nebula_cli.schedulers.kubernetes.spec import (
    _DNS_LABEL,
    _LABEL_VALUE,
    _QUALIFIED_NAME,
    KubernetesSpec,
)

GOLDEN = Path(__file__).parent / "golden"
VERSIONS = ("1.28.0", "1.33.0")
"""The oldest Kubernetes with the Job's pod index label (beta, on by default), and a recent one."""

LAUNCH = PodLaunch(job_id="a1b2c3d4", cluster="east", rendezvous_port=29500, relay_port=7443,
                   command=("python", "-u", "-m", "nebula_cli.agent.keeper", "serve", "east"),
                   env={"NEBULA_CLUSTER": "east", "NEBULA_JOB": "a1b2c3d4"},
                   checkpoint_dir="/ckpt/east", grace_s=30)

SPECS = {
    "gpu-loadbalancer": {
        "image": "registry.example.com/nebula:0.1", "namespace": "ml", "pods": 4,
        "resources": {"gpus": 8, "cpu": "64", "memory": "512Gi"},
        "node_selector": {"nvidia.com/gpu.product": "H100-SXM"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "service_account": "trainer", "image_pull_secrets": ["regcred"],
        "annotations": {"example.com/team": "pretrain"}, "checkpoint_claim": "east-ckpt"},
    "cpu-nodeport": {"image": "nebula:dev", "pods": 2, "relay_exposure": "NodePort",
                     "checkpoint_claim": "ckpt"},
    "dial-out": {"image": "nebula:dev", "relay_exposure": "dial-out",
                 "checkpoint_claim": "ckpt"},
}


def _objects(name: str, **files: bytes):
    spec = KubernetesSpec.model_validate(SPECS[name])
    return cluster_objects(spec, LAUNCH, files or None)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_object_is_valid_for_the_kubernetes_api(name: str, version: str) -> None:
    for obj in _objects(name, **{k: b"x" for k in secret_names()}).all():
        kubernetes_validate.validate(obj, version, strict=True)  # raises on any problem
    for obj in _objects(name).all():  # with placeholders, as emitted
        kubernetes_validate.validate(obj, version, strict=True)


def test_a_field_the_api_does_not_know_is_caught_by_the_schemas() -> None:
    """(The check above can fail: a misspelt field of the Job's pod is refused.)"""
    job = _objects("dial-out").job
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, VERSIONS[0], strict=True)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_what_a_spec_becomes_is_its_golden_file(name: str, tmp_path: Path) -> None:
    objects = _objects(name).all()
    text = "---\n".join(yaml.safe_dump(o, sort_keys=False) for o in objects)
    golden = GOLDEN / f"{name}.yaml"
    if os.environ.get("NEBULA_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} differs (NEBULA_UPDATE_GOLDEN=1 rewrites it)"
    written = write(objects, tmp_path / "manifests")
    assert [p.name for p in written] == [file_name(o) for o in objects]
    assert [yaml.safe_load(p.read_text()) for p in written] == objects


def test_one_indexed_job_that_kubernetes_never_restarts_on_its_own() -> None:
    objs = _objects("gpu-loadbalancer")
    job = objs.job["spec"]
    pod = job["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == 4
    assert job["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert pod["subdomain"] == objs.service["metadata"]["name"]  # pod i: <job>-<i>.<service>
    assert objs.service["spec"]["clusterIP"] == "None"
    (worker,) = pod["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert worker["resources"]["limits"] == worker["resources"]["requests"]
    mounts = {m["name"]: m for m in worker["volumeMounts"]}
    assert mounts["checkpoints"]["mountPath"] == "/ckpt/east" and mounts["tls"]["readOnly"]
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"name": "checkpoints",
                       "persistentVolumeClaim": {"claimName": "east-ckpt"}}]
    relay = objs.relay_service["spec"]
    assert relay["type"] == "LoadBalancer"
    assert relay["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    assert _objects("dial-out").relay_service is None
    assert _objects("cpu-nodeport").relay_service["spec"]["type"] == "NodePort"
    for obj in objs.all():  # found (and deleted) by the job's labels
        assert obj["metadata"]["labels"]["nebula.dev/job"] == "a1b2c3d4"
        assert obj["metadata"]["namespace"] == "ml"


def test_keys_are_only_in_the_secret_and_emitted_manifests_hold_none() -> None:
    key = b"-----BEGIN PRIVATE KEY-----\nsecret-material\n"
    objs = _objects("cpu-nodeport", **{"cluster.key": key, "cluster.crt": b"crt",
                                       "ca.crt": b"ca", "world-secret": b"w0rld"})
    assert base64.b64decode(objs.secret["data"]["cluster.key"]) == key
    rest = yaml.safe_dump([objs.job, objs.service, objs.relay_service])
    for needle in ("secret-material", base64.b64encode(key).decode()[:20], "w0rld"):
        assert needle not in rest  # neither in the pod's spec nor in its environment
    emitted = _objects("cpu-nodeport").secret
    assert "data" not in emitted
    assert emitted["stringData"] == {k: PLACEHOLDER for k in secret_names()}
    assert "ca.key" not in secret_names()  # the CA's key never leaves the launching machine


def _names_and_labels_are_kubernetes_ones(objs) -> None:
    """(The schemas check no name or label: Kubernetes' own rules, and every Service selects
    the Job's pods.)"""
    pod_labels = objs.job["spec"]["template"]["metadata"]["labels"]
    for obj in objs.all():
        name = obj["metadata"]["name"]
        assert _DNS_LABEL.fullmatch(name), name
        for key, value in obj["metadata"]["labels"].items():
            assert _QUALIFIED_NAME.fullmatch(key) and _LABEL_VALUE.fullmatch(value), (key, value)
        selector = obj.get("spec", {}).get("selector")
        if obj["kind"] == "Service":
            assert {k: v for k, v in selector.items() if k != INDEX_LABEL}.items() <= (
                pod_labels.items()), selector
    assert len(f"{objs.job['metadata']['name']}-4095") <= 63


@pytest.mark.parametrize(("job_id", "cluster"), [
    ("a1b2c3d4", "east"),
    ("0123456789abcdef" * 3, "A_Very.Long Cluster Name" * 3),
    ("pretrain-llama3-70b-20261203-062740-e099", "gke-east-a"),
    ("j-", "-x_"),
])
def test_names_and_labels_fit_kubernetes_rules_whatever_the_job_and_cluster_are_called(
        job_id: str, cluster: str) -> None:
    name = base_name(job_id, cluster)
    assert len(name) <= NAME_MAX and len(f"{name}-relay") <= 63
    launch = PodLaunch(job_id=job_id, cluster=cluster, command=("true",), rendezvous_port=1,
                       relay_port=2)
    objs = cluster_objects(KubernetesSpec.model_validate(SPECS["cpu-nodeport"]), launch)
    _names_and_labels_are_kubernetes_ones(objs)
    for obj in objs.all():
        kubernetes_validate.validate(obj, VERSIONS[1], strict=True)


def test_two_clusters_never_share_an_object_name() -> None:
    """Names cut to fit, or changed to be DNS labels, end in a hash of the job and cluster."""
    job = "pretrain-llama3-70b-20261203-062740-e099"
    names = {base_name(job, c) for c in ("gke-east-a", "gke-east-b", "east_1", "east-1")}
    assert len(names) == 4, names
    assert base_name("a1b2c3d4", "east") == "nebula-a1b2c3d4-east"  # kept as is when it fits


def test_the_ranks_meet_at_pod_0_by_its_service_name_with_memory_for_dev_shm() -> None:
    objs = _objects("gpu-loadbalancer")
    pod = objs.job["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    name = objs.service["metadata"]["name"]
    assert env["MASTER_ADDR"] == f"{name}-0.{name}.ml.svc" and env["MASTER_PORT"] == "29500"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    _names_and_labels_are_kubernetes_ones(objs)


def test_a_checkpoint_folder_on_the_pods_own_disk_is_refused_with_the_fix() -> None:
    spec = KubernetesSpec.model_validate({"image": "nebula:dev"})
    with pytest.raises(ManifestError, match="kubernetes.checkpoint_claim"):
        cluster_objects(spec, LAUNCH)
    no_checkpoints = PodLaunch(job_id="j", cluster="c", command=("true",), rendezvous_port=1,
                               relay_port=2)
    pod = cluster_objects(spec, no_checkpoints).job["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["tls", "dshm"]  # no checkpoint volume


def test_a_restarted_cluster_s_services_select_only_its_own_pods() -> None:
    """Recreated under the same names, a cluster's Services select the new start's pods: an
    earlier start's pods, still terminating, are neither pod 0 nor in the rendezvous."""
    spec = KubernetesSpec.model_validate(SPECS["cpu-nodeport"])
    first = cluster_objects(spec, LAUNCH)
    again = cluster_objects(spec, dataclasses.replace(LAUNCH, attempt=1))
    assert [o["metadata"]["name"] for o in first.all()] == [
        o["metadata"]["name"] for o in again.all()]
    old_pod = first.job["spec"]["template"]["metadata"]["labels"]
    for service in (again.service, again.relay_service):
        selector = service["spec"]["selector"]
        assert selector["nebula.dev/attempt"] == "1"
        assert not selector.items() <= {**old_pod, INDEX_LABEL: "0"}.items()
    _names_and_labels_are_kubernetes_ones(again)
