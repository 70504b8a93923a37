"""On a real cluster: install the chart, serve the CPU example, chat, scale, delete.

The tests run in order and share one operator release and one namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from .conftest import ROOT, E2ESettings

pytestmark = pytest.mark.k8s

GROUP, VERSION, PLURAL = "kvpilot.dev", "v1alpha1", "inferenceservices"
NAME = "smollm2"
CHART = ROOT / "charts" / "kvpilot"


def wait_for(
    check: Callable[[], Any],
    timeout_s: float,
    what: str,
    interval: float = 2.0,
    describe: Callable[[], Any] | None = None,
) -> Any:
    """Polls `check` until truthy; on timeout, `describe()` says what the cluster shows."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    seen = f": {describe()!r}" if describe is not None else ""
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}{seen}")


@pytest.fixture(scope="module")
def apis(kube: Any) -> dict[str, Any]:
    from kubernetes import client

    return {
        "core": client.CoreV1Api(kube),
        "apps": client.AppsV1Api(kube),
        "custom": client.CustomObjectsApi(kube),
        "ext": client.ApiextensionsV1Api(kube),
    }


@pytest.fixture(scope="module")
def release(e2e: E2ESettings, apis: dict[str, Any]) -> Iterator[str]:
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
        "resyncSeconds": 5,
        "logLevel": "debug",
    }
    with helm.Config(
        kubeconfig_path=os.environ["KUBECONFIG"], namespace=e2e.operator_namespace
    ) as cfg:
        cfg.install(CHART, "kvpilot", values, create_namespace=True, wait="watcher", timeout=300)
        try:
            yield "kvpilot"
        finally:
            with contextlib.suppress(Exception):
                apis["custom"].delete_collection_namespaced_custom_object(
                    GROUP, VERSION, e2e.namespace, PLURAL
                )
            time.sleep(5)  # let the operator release its finalizers before it goes
            cfg.uninstall("kvpilot", wait="watcher", timeout=300, ignore_not_found=True)
            for namespace in (e2e.namespace, e2e.operator_namespace):
                with contextlib.suppress(Exception):
                    apis["core"].delete_namespace(namespace)


def get_isvc(apis: dict[str, Any], e2e: E2ESettings, name: str = NAME) -> dict[str, Any]:
    return apis["custom"].get_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, name)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for found in (obj.get("status") or {}).get("conditions") or []:
        if found["type"] == type_:
            return found
    return {}


def test_operator_is_running_with_the_crd(
    release: str, e2e: E2ESettings, apis: dict[str, Any]
) -> None:
    crd = apis["ext"].read_custom_resource_definition("inferenceservices.kvpilot.dev")
    assert crd.spec.names.short_names == ["kis"]
    deployment = apis["apps"].read_namespaced_deployment("kvpilot", e2e.operator_namespace)
    assert deployment.status.available_replicas == 1


def test_cpu_example_becomes_ready(release: str, e2e: E2ESettings, apis: dict[str, Any]) -> None:
    body = yaml.safe_load((ROOT / "examples" / "smollm2-cpu.yaml").read_text())
    body["metadata"]["namespace"] = e2e.namespace
    apis["custom"].create_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, body)
    ready = wait_for(
        lambda: (
            condition(get_isvc(apis, e2e), "Ready").get("status") == "True"
            or condition(get_isvc(apis, e2e), "Ready")
        ),
        e2e.timeout_s,
        "Ready=True",
        interval=5,
    )
    obj = get_isvc(apis, e2e)
    assert condition(obj, "Ready")["status"] == "True", ready
    assert obj["status"]["url"] == f"http://{NAME}.{e2e.namespace}.svc:8000/v1"
    assert obj["status"]["model"] == NAME
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def port_forward(namespace: str, target: str, remote_port: int) -> Iterator[int]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is needed on PATH for the port-forward")
    port = free_port()
    process = subprocess.Popen(
        [kubectl, "-n", namespace, "port-forward", target, f"{port}:{remote_port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: _is_listening(port), 30, "the port-forward", interval=0.5)
        yield port
    finally:
        process.terminate()
        process.wait(10)


def _is_listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_chat_through_a_port_forward(release: str, e2e: E2ESettings) -> None:
    import httpx
    from openai import OpenAI

    with port_forward(e2e.namespace, f"svc/{NAME}", 8000) as port:
        base = f"http://127.0.0.1:{port}"
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        assert NAME in [model.id for model in client.models.list()]
        reply = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200


def test_scale_through_the_scale_subresource(
    release: str, e2e: E2ESettings, apis: dict[str, Any]
) -> None:
    # What `kubectl scale kis/smollm2 --replicas=2`, an HPA or KEDA do.
    apis["custom"].patch_namespaced_custom_object_scale(
        GROUP, VERSION, e2e.namespace, PLURAL, NAME, {"spec": {"replicas": 2}}
    )
    wait_for(
        lambda: apis["apps"].read_namespaced_deployment(NAME, e2e.namespace).spec.replicas == 2,
        60,
        "the Deployment to scale to 2",
    )
    scale = apis["custom"].get_namespaced_custom_object_scale(
        GROUP, VERSION, e2e.namespace, PLURAL, NAME
    )
    assert scale["spec"]["replicas"] == 2
    wait_for(
        lambda: (get_isvc(apis, e2e).get("status") or {}).get("readyReplicas") == 2,
        e2e.timeout_s,
        "2 ready replicas",
        interval=5,
        describe=lambda: get_isvc(apis, e2e).get("status"),
    )


def test_the_api_server_rejects_invalid_objects(
    release: str, e2e: E2ESettings, apis: dict[str, Any]
) -> None:
    from kubernetes.client.exceptions import ApiException

    bad = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": "both", "namespace": e2e.namespace},
        "spec": {
            "model": {"uri": "builtin://smollm2-135m-instruct"},
            "replicas": 1,
            "autoscaling": {"maxReplicas": 2},
        },
    }
    with pytest.raises(ApiException) as caught:
        apis["custom"].create_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, bad)
    assert caught.value.status == 422
    assert "mutually exclusive" in caught.value.body
    bad["spec"] = {"model": {"uri": "s3://bucket/model"}}
    with pytest.raises(ApiException) as caught:
        apis["custom"].create_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, bad)
    assert caught.value.status == 422 and "spec.model.uri" in caught.value.body


def test_delete_removes_the_children(release: str, e2e: E2ESettings, apis: dict[str, Any]) -> None:
    from kubernetes.client.exceptions import ApiException

    apis["custom"].delete_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, NAME)

    def gone(read: Callable[[], Any]) -> bool:
        try:
            read()
        except ApiException as error:
            return error.status == 404
        return False

    wait_for(lambda: gone(lambda: get_isvc(apis, e2e)), 120, "the InferenceService to go")
    wait_for(
        lambda: gone(lambda: apis["apps"].read_namespaced_deployment(NAME, e2e.namespace)),
        120,
        "the garbage collector to delete the Deployment",
    )
    wait_for(
        lambda: gone(lambda: apis["core"].read_namespaced_service(NAME, e2e.namespace)),
        120,
        "the garbage collector to delete the Service",
    )
