"""End-to-end tests on a real cluster (kind or k3d): opt in with KUBECONFIG.

    docker build -t kvpilot:dev . && kind load docker-image kvpilot:dev
    KUBECONFIG=~/.kube/config KVPILOT_E2E_IMAGE=kvpilot:dev pytest e2e -v

See operator/README.md ("End-to-end tests") for k3d and the knobs below.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_REASON = (
    "needs a real Kubernetes cluster: set KUBECONFIG (kind or k3d; see operator/README.md, "
    "'End-to-end tests')"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KUBECONFIG"):
        return
    for item in items:
        if "k8s" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@dataclass(frozen=True)
class E2ESettings:
    image: str  # repository:tag of the one kvpilot image, loaded into the cluster
    pull_policy: str
    timeout_s: float  # how long an InferenceService may take to become Ready
    namespace: str  # where the InferenceServices go (the operator watches only it)
    operator_namespace: str


@pytest.fixture(scope="session")
def e2e() -> E2ESettings:
    suffix = uuid.uuid4().hex[:6]
    return E2ESettings(
        image=os.environ.get("KVPILOT_E2E_IMAGE", "kvpilot:dev"),
        pull_policy=os.environ.get("KVPILOT_E2E_PULL_POLICY", "IfNotPresent"),
        timeout_s=float(os.environ.get("KVPILOT_E2E_TIMEOUT", "900")),
        namespace=f"kvpilot-e2e-{suffix}",
        operator_namespace=f"kvpilot-system-{suffix}",
    )


@pytest.fixture(scope="session")
def kube() -> Iterator[object]:
    from kubernetes import client, config

    config.load_kube_config(config_file=os.environ["KUBECONFIG"])
    api = client.ApiClient()
    yield api
    api.close()
