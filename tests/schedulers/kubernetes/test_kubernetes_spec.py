"""The `kubernetes:` section: defaults, resources, and refusal of values Kubernetes rejects."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nebula_cli.schedulers.kubernetes.spec import KubernetesSpec, RelayExposure


def test_defaults_and_resources() -> None:
    spec = KubernetesSpec.model_validate({
        "image": "registry.example.com/nebula:1.0",
        "resources": {"gpus": 8, "cpu": "32", "memory": "256Gi"},
        "node_selector": {"example.com/pool": "h200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "relay_exposure": "NodePort"})
    assert spec.namespace == "default"
    assert spec.pods == 1
    assert spec.relay_exposure is RelayExposure.NODE_PORT
    assert spec.resources.as_requests() == {"cpu": "32", "memory": "256Gi",
                                            "nvidia.com/gpu": "8"}


@pytest.mark.parametrize(("field", "value"), [
    ("namespace", "Bad_Name"), ("image", "has space"), ("relay_exposure", "Ingress"),
    ("node_selector", {"bad key!": "x"}), ("image_pull_secrets", ["UPPER"]),
    ("pods", 0), ("checkpoint_claim", "Claim_1"), ("unknown", 1)])
def test_refuses(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as err:
        KubernetesSpec.model_validate({"image": "nebula:1", field: value})
    assert field in str(err.value)


def test_cpu_quantity_refused() -> None:
    with pytest.raises(ValidationError, match="quantity"):
        KubernetesSpec.model_validate({"image": "nebula:1", "resources": {"cpu": "lots"}})
