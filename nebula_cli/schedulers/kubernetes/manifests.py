"""The objects one Kubernetes cluster of a job is made of, as the API takes them.

Per cluster (issue 44):

- an **Indexed Job** of `pods` worker pods (`completionMode: Indexed`, all of them at once),
  each running the node agent's command; `backoffLimit: 0` and `restartPolicy: Never`, so
  that Kubernetes never restarts a pod or the Job on its own: only nebula restarts a cluster,
  by deleting the Job and creating it again, from its checkpoint;
- a **headless Service** (`clusterIP: None`) named as the pods' `subdomain`: pod *i* is
  ``<job>-<i>.<service>.<namespace>.svc``, the ranks' rendezvous at pod 0's name
  (``MASTER_ADDR``, named down to `.svc`: a pod's bare hostname does not resolve from other
  pods, and the cluster's domain comes from the pods' DNS search list); its
  addresses are published while the pods start (there is no readiness probe to wait for);
- a **Secret** with the pods' certificates and keys and the job's world secret, mounted
  read-only (0400) at :data:`TLS_DIR`: never in the pod's spec or environment, and never the
  CA's key. Emitted for review (:func:`write`) it holds placeholders, not keys;
- unless the relay dials out (`relay_exposure: dial-out`), a **Service** of type LoadBalancer
  or NodePort in front of pod 0, where the cluster's relay runs (as on a Slurm allocation's
  first node), for the other clusters' relays.

Every object carries the labels :func:`labels` names (the nebula job and cluster), so that
`stop` can find and delete all of them (an API without garbage collection deletes nothing on
its own). ``checkpoint.dir`` is a PersistentVolumeClaim's mount (`checkpoint_claim`): a pod's
own disk dies with it; ``/dev/shm`` is a memory volume (a container's own is 64 MiB:
DeepSpeed's CPU all-reduce buffers and the checkpoint's staging live there). Names are DNS
labels: a job or cluster name that had to be cut or changed to fit gets a short hash of both,
so two clusters never share an object. The objects are plain data in the API's JSON shape; what
makes them is typed (:class:`PodLaunch`, `KubernetesSpec`).
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nebula_cli.schedulers.kubernetes.spec import KubernetesSpec, RelayExposure

TLS_DIR = "/etc/nebula/tls"
"""Where every pod finds the Secret's files."""
NAME_MAX = 52
"""The longest base name: a pod is `<job>-<index>` (index up to 4095), a DNS label of at most
63, and the relay's Service adds `-relay`."""
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
"""The label (and annotation) the Job controller gives each pod: its index."""
LABEL_JOB, LABEL_CLUSTER = "nebula.dev/job", "nebula.dev/cluster"
LABEL_ATTEMPT = "nebula.dev/attempt"
"""Which start of the cluster an object belongs to: the Services select only its own pods, so
pods of an earlier start still terminating (up to their grace) are in no Service's
endpoints while the cluster is recreated under the same names."""
PLACEHOLDER = "<written by nebula launch>"
"""A Secret's value in emitted manifests (never a key on disk for review)."""
Obj = dict[str, Any]


@dataclass(frozen=True)
class PodLaunch:
    """What every worker pod of one cluster runs and is told, from the job's plan."""

    job_id: str
    cluster: str
    command: tuple[str, ...]
    """The node agent's command line (the image's python)."""
    rendezvous_port: int
    """The ranks' store on pod 0 (MASTER_PORT)."""
    relay_port: int
    """The cluster's relay on pod 0."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Plain settings only: secrets travel in the Secret."""
    checkpoint_dir: str | None = None
    """The spec's `checkpoint.dir` (None: no checkpoints)."""
    grace_s: int = 30
    """Seconds a stopping pod has before SIGKILL (the job's `grace`)."""
    attempt: int = 0
    """The cluster's start (0 at launch, one more at each restart by nebula)."""


class ManifestError(ValueError):
    """A cluster that cannot be made into objects (said with the fix)."""


def base_name(job_id: str, cluster: str) -> str:
    """`nebula-<job>-<cluster>` as a DNS label of at most :data:`NAME_MAX` characters; when it
    had to be changed or cut to be one, its end is a hash of the job and cluster as they are
    (`east_1` and `east-1`, or two long names alike at the start, stay apart)."""
    raw = f"nebula-{job_id}-{cluster}"
    name = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]+", "-", raw.lower())).strip("-")
    if name == raw and len(name) <= NAME_MAX:
        return name
    tag = hashlib.sha256(f"{job_id}\0{cluster}".encode()).hexdigest()[:8]
    return f"{name[:NAME_MAX - len(tag) - 1].rstrip('-')}-{tag}"


def labels(job_id: str, cluster: str) -> dict[str, str]:
    """What every object of the cluster is labelled with (and found by)."""
    return {"app.kubernetes.io/name": "nebula", "app.kubernetes.io/managed-by": "nebula",
            LABEL_JOB: _label_value(job_id), LABEL_CLUSTER: _label_value(cluster)}


def _label_value(text: str) -> str:
    """``text`` as a label value (at most 63 of letters, digits, '-', '_', '.', alphanumeric
    at both ends)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63].strip("-_.") or "x"


@dataclass(frozen=True)
class ClusterObjects:
    """One cluster's objects, in the order they are created (and deleted in reverse)."""

    secret: Obj
    service: Obj
    job: Obj
    relay_service: Obj | None

    def all(self) -> list[Obj]:
        return [o for o in (self.secret, self.service, self.relay_service, self.job)
                if o is not None]


def cluster_objects(spec: KubernetesSpec, launch: PodLaunch,
                    secret_files: Mapping[str, bytes] | None = None) -> ClusterObjects:
    """The objects of one cluster. ``secret_files``: the Secret's files (name -> content); None
    writes :data:`PLACEHOLDER` for each (manifests for review)."""
    if launch.checkpoint_dir is not None and spec.checkpoint_claim is None:
        raise ManifestError(
            f"cluster {launch.cluster}: checkpoint.dir {launch.checkpoint_dir} would be the "
            "pod's own disk, lost with the pod: name a PersistentVolumeClaim as "
            "kubernetes.checkpoint_claim")
    if launch.checkpoint_dir is not None and not launch.checkpoint_dir.startswith("/"):
        raise ManifestError(f"cluster {launch.cluster}: checkpoint.dir must be an absolute "
                            f"path in the pod, found {launch.checkpoint_dir!r}")
    name = base_name(launch.job_id, launch.cluster)
    meta = {"namespace": spec.namespace, "labels": {
        **labels(launch.job_id, launch.cluster), LABEL_ATTEMPT: str(launch.attempt)}}
    return ClusterObjects(
        secret=_secret(f"{name}-tls", meta, secret_files),
        service=_headless(name, meta, launch),
        job=_job(name, meta, spec, launch),
        relay_service=_relay_service(f"{name}-relay", meta, spec, launch))


def secret_names() -> tuple[str, ...]:
    """The files of the pods' Secret (what `launch` puts there; placeholders when emitted)."""
    return ("ca.crt", "cluster.crt", "cluster.key", "world-secret")


def _secret(name: str, meta: Obj, files: Mapping[str, bytes] | None) -> Obj:
    body: Obj = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, **meta},
                 "type": "Opaque"}
    if files is None:
        body["stringData"] = {k: PLACEHOLDER for k in secret_names()}
    else:
        body["data"] = {k: base64.b64encode(v).decode() for k, v in sorted(files.items())}
    return body


def _headless(name: str, meta: Obj, launch: PodLaunch) -> Obj:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, **meta},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": dict(meta["labels"]),
                     "ports": [{"name": "rendezvous", "port": launch.rendezvous_port,
                                "targetPort": launch.rendezvous_port, "protocol": "TCP"}]}}


def _relay_service(name: str, meta: Obj, spec: KubernetesSpec, launch: PodLaunch
                   ) -> Obj | None:
    if spec.relay_exposure is RelayExposure.DIAL_OUT:
        return None
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, **meta},
            "spec": {"type": spec.relay_exposure.value,
                     "selector": {**meta["labels"], INDEX_LABEL: "0"},
                     "ports": [{"name": "relay", "port": launch.relay_port,
                                "targetPort": launch.relay_port, "protocol": "TCP"}]}}


def _job(name: str, meta: Obj, spec: KubernetesSpec, launch: PodLaunch) -> Obj:
    requests = spec.resources.as_requests()
    container: Obj = {
        "name": "worker", "image": spec.image, "command": list(launch.command),
        # (the Job controller adds JOB_COMPLETION_INDEX, the pod's index)
        "env": [{"name": k, "value": v} for k, v in sorted(launch.env.items())]
               + [{"name": "NEBULA_TLS_DIR", "value": TLS_DIR},
                  {"name": "MASTER_ADDR",
                   "value": f"{name}-0.{name}.{spec.namespace}.svc"},
                  {"name": "MASTER_PORT", "value": str(launch.rendezvous_port)}],
        "ports": [{"name": "rendezvous", "containerPort": launch.rendezvous_port},
                  {"name": "relay", "containerPort": launch.relay_port}],
        "volumeMounts": [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if requests:
        container["resources"] = {"requests": dict(requests), "limits": dict(requests)}
    volumes: list[Obj] = [{"name": "tls", "secret": {"secretName": f"{name}-tls",
                                                     "defaultMode": 0o400}},
                          {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if launch.checkpoint_dir is not None and spec.checkpoint_claim is not None:
        container["volumeMounts"].append({"name": "checkpoints",
                                          "mountPath": launch.checkpoint_dir})
        volumes.append({"name": "checkpoints",
                        "persistentVolumeClaim": {"claimName": spec.checkpoint_claim}})
    pod: Obj = {"subdomain": name, "restartPolicy": "Never",
                "terminationGracePeriodSeconds": launch.grace_s + 10,
                "containers": [container], "volumes": volumes}
    if spec.service_account:
        pod["serviceAccountName"] = spec.service_account
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = [t.model_dump(exclude_none=True) for t in spec.tolerations]
    template: Obj = {"metadata": {"labels": dict(meta["labels"])}, "spec": pod}
    if spec.annotations:
        template["metadata"]["annotations"] = dict(spec.annotations)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, **meta},
            "spec": {"completionMode": "Indexed", "completions": spec.pods,
                     "parallelism": spec.pods, "backoffLimit": 0, "template": template}}


def file_name(obj: Obj) -> str:
    """`<kind>-<name>.yaml`, lower case."""
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def write(objects: list[Obj], folder: Path) -> list[Path]:
    """One YAML file per object in ``folder`` (made 0700 if new); the files written."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = []
    for obj in objects:
        path = folder / file_name(obj)
        path.write_text(yaml.safe_dump(obj, sort_keys=False))
        out.append(path)
    return out
