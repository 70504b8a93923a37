"""End-to-end tests on a real cluster (kind or k3d): opt in with KUBECONFIG.

    docker build -t kvpilot:dev . && kind load docker-image kvpilot:dev
    KUBECONFIG=~/.kube/config KVPILOT_E2E_IMAGE=kvpilot:dev pytest e2e -v

See operator/README.md ("End-to-end tests") for k3d and the knobs below. On a control plane
without nodes (a real kube-apiserver and controller-manager), KVPILOT_E2E_KUBELET=standin runs
the pods here (standin_cluster.py; e2e/run-real-apiserver.sh).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .standin_cluster import StandinCluster, is_standin, standin_cluster

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvpilot"
GROUP, VERSION, PLURAL = "kvpilot.dev", "v1alpha1", "inferenceservices"
RESYNC_SECONDS = 5  # the operator's resync period in the e2e release
ADAPTER_SYNC_SECONDS = 2  # and its LoRA adapter sync's
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


@pytest.fixture(scope="session")
def apis(kube: Any) -> dict[str, Any]:
    from kubernetes import client

    return {
        "core": client.CoreV1Api(kube),
        "apps": client.AppsV1Api(kube),
        "custom": client.CustomObjectsApi(kube),
        "ext": client.ApiextensionsV1Api(kube),
    }


@pytest.fixture(scope="session")
def standin(
    e2e: E2ESettings, apis: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StandinCluster | None]:
    """The kubelet stand-ins of the release's and the test namespace, where the tests run the
    pods themselves (KVPILOT_E2E_KUBELET=standin); None on a cluster with nodes."""
    if not is_standin():
        yield None
        return
    namespaces = [e2e.operator_namespace, e2e.namespace]
    work = tmp_path_factory.mktemp("standin")
    with standin_cluster(apis["core"], namespaces, work, e2e.timeout_s) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def pod_logs(apis: dict[str, Any], standin: StandinCluster | None) -> Callable[[str, str], str]:
    """(namespace, pod) -> the pod's log, from the kubelet or the stand-in."""
    if standin is not None:
        return standin.pod_log
    return lambda namespace, pod: apis["core"].read_namespaced_pod_log(pod, namespace)


@pytest.fixture(scope="session")
def release(
    e2e: E2ESettings, apis: dict[str, Any], standin: StandinCluster | None
) -> Iterator[str]:
    """The chart installed by real Helm (helm-python-sdk), watching the test namespace only."""
    import helm_python as helm
    from kubernetes import client

    apis["core"].create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=e2e.namespace))
    )
    repository, _, tag = e2e.image.rpartition(":")
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": e2e.pull_policy},
        "watchNamespaces": [e2e.namespace],
        "resyncSeconds": RESYNC_SECONDS,
        "adapters": {"syncIntervalSeconds": ADAPTER_SYNC_SECONDS},
        "logLevel": "debug",
        # Tenants name Secrets of API keys; the operator counts them (test_rbac_real_apiserver).
        "rbac": {"readApiKeySecrets": True},
    }
    with helm.Config(
        kubeconfig_path=os.environ["KUBECONFIG"], namespace=e2e.operator_namespace
    ) as cfg:
        # Helm's wait holds the interpreter while it blocks: where the stand-ins run the pods
        # in this process, the test waits for the Deployments itself.
        wait = None if standin is not None else "watcher"
        cfg.install(CHART, "kvpilot", values, create_namespace=True, wait=wait, timeout=300)
        if standin is not None:
            _wait_available(apis, e2e.operator_namespace, standin)
        try:
            yield "kvpilot"
        finally:
            with contextlib.suppress(Exception):
                apis["custom"].delete_collection_namespaced_custom_object(
                    GROUP, VERSION, e2e.namespace, PLURAL
                )
            time.sleep(5)  # let the operator release its finalizers before it goes
            cfg.uninstall("kvpilot", wait=wait, timeout=300, ignore_not_found=True)
            for namespace in (e2e.namespace, e2e.operator_namespace):
                with contextlib.suppress(Exception):
                    apis["core"].delete_namespace(namespace)


def _wait_available(apis: dict[str, Any], namespace: str, standin: StandinCluster) -> None:
    """What Helm's wait does: every Deployment of `namespace` has all its replicas available."""
    from .cluster import wait_for

    def available() -> bool:
        items = apis["apps"].list_namespaced_deployment(namespace).items
        return bool(items) and all(
            (d.status.available_replicas or 0) == d.spec.replicas for d in items
        )

    wait_for(available, 300, f"the release's Deployments in {namespace}", 1.0, standin.errors)
