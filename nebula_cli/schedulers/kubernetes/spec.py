"""The spec's `kubernetes:` section of a cluster whose workers run as pods (issue 44).

Each field's default is defined here, once. Names follow Kubernetes' own rules (RFC 1123
labels and subdomains, qualified label keys, resource quantities), so a bad value is refused
at the spec's file:line:col rather than by the API server later.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, Field, field_validator

from nebula_cli.config.sections import SpecModel

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?"
                            r"(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                             r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_QUANTITY = re.compile(r"^\d+(\.\d+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$")
_CONTEXT = re.compile(r"^[^\x00-\x1f\x7f]{1,253}$")


def _matching(pattern: re.Pattern[str], what: str):
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"expected {what}, found {value!r}")
        return value
    return AfterValidator(check)


DnsLabel = Annotated[str, _matching(_DNS_LABEL, "a Kubernetes name (RFC 1123 label: lower-case "
                                               "letters, digits, '-', at most 63)")]
DnsSubdomain = Annotated[str, _matching(_DNS_SUBDOMAIN, "a Kubernetes object name (RFC 1123 "
                                                         "subdomain)")]
LabelKey = Annotated[str, _matching(_QUALIFIED_NAME, "a label or annotation key such as "
                                                     "\"example.com/pool\"")]
LabelValue = Annotated[str, _matching(_LABEL_VALUE, "a label value (at most 63 letters, digits, "
                                                    "'-', '_', '.')")]
Quantity = Annotated[str, _matching(_QUANTITY, "a Kubernetes quantity such as \"8\", \"500m\" or "
                                               "\"64Gi\"")]
Image = Annotated[str, _matching(_IMAGE, "a container image such as "
                                         "\"registry.example.com/nebula:1.0\"")]
Context = Annotated[str, _matching(_CONTEXT, "a kubeconfig context name")]


class RelayExposure(StrEnum):
    """How the cluster's relay is reached by the other clusters."""

    LOAD_BALANCER = "LoadBalancer"
    """A Service of type LoadBalancer in front of the relay pod."""
    NODE_PORT = "NodePort"
    """A Service of type NodePort: the relay at a node's address."""
    DIAL_OUT = "dial-out"
    """No inbound Service: the relay dials out to the other clusters' relays."""


class TolerationSpec(SpecModel):
    """One pod toleration, as Kubernetes spells it."""

    key: LabelKey | None = None
    operator: str = Field("Equal", pattern=r"^(Equal|Exists)$")
    value: LabelValue | None = None
    effect: str | None = Field(None, pattern=r"^(NoSchedule|PreferNoSchedule|NoExecute)$")


class PodResources(SpecModel):
    """Requests (= limits) of each worker pod."""

    gpus: int = Field(0, ge=0, le=64)
    """`nvidia.com/gpu` per pod (0: a CPU pod, nothing asked)."""
    cpu: Quantity | None = None
    """`cpu` per pod. Default: none asked."""
    memory: Quantity | None = None
    """`memory` per pod. Default: none asked."""

    def as_requests(self) -> dict[str, str]:
        """The pod's resource requests (and limits) as Kubernetes spells them."""
        asked = {"cpu": self.cpu, "memory": self.memory}
        out = {k: v for k, v in asked.items() if v is not None}
        if self.gpus:
            out["nvidia.com/gpu"] = str(self.gpus)
        return out


class KubernetesSpec(SpecModel):
    """What to ask Kubernetes for: one Indexed Job of worker pods per cluster."""

    context: Context | None = None
    """The kubeconfig context. Default: the kubeconfig's current context."""
    namespace: DnsLabel = "default"
    """The namespace of the job's objects."""
    image: Image
    """The container image of the worker pods (nebula installed)."""
    pods: int = Field(1, ge=1, le=4096)
    """Pods of the cluster's DeepSpeed world (the Indexed Job's completions)."""
    resources: PodResources = Field(default_factory=PodResources)
    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    tolerations: list[TolerationSpec] = Field(default_factory=list)
    service_account: DnsSubdomain | None = None
    """The pods' service account. Default: the namespace's default."""
    image_pull_secrets: list[DnsSubdomain] = Field(default_factory=list)
    annotations: dict[LabelKey, str] = Field(default_factory=dict)
    """Added to every pod."""
    relay_exposure: RelayExposure = RelayExposure.LOAD_BALANCER
    """How the relay is reached (see `RelayExposure`)."""
    checkpoint_claim: DnsSubdomain | None = None
    """The PersistentVolumeClaim mounted at the job's `checkpoint.dir` in every pod (a pod's
    own disk dies with it: a cluster restarted after a lost pod resumes from this volume)."""

    @field_validator("relay_exposure", mode="before")
    @classmethod
    def _exposure(cls, value: object) -> object:
        """The spec is YAML text: accept the enum's value (strict mode wants the enum)."""
        if isinstance(value, str):
            try:
                return RelayExposure(value)
            except ValueError:
                names = ", ".join(e.value for e in RelayExposure)
                raise ValueError(f"expected one of {names}, found {value!r}") from None
        return value
