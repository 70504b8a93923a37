"""On a real cluster: install the chart, serve the CPU example, chat, scale, delete.

The tests run in order and share one operator release and one namespace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml

from .cluster import condition, get_isvc, port_forward, wait_for, wait_ready
from .conftest import GROUP, PLURAL, ROOT, VERSION, E2ESettings

pytestmark = pytest.mark.k8s

NAME = "smollm2"


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
    obj = wait_ready(apis, e2e, NAME)
    assert condition(obj, "Ready")["reason"] == "Serving"
    assert obj["status"]["url"] == f"http://{NAME}.{e2e.namespace}.svc:8000/v1"
    assert obj["status"]["model"] == NAME
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]


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
        lambda: (get_isvc(apis, e2e, NAME).get("status") or {}).get("readyReplicas") == 2,
        e2e.timeout_s,
        "2 ready replicas",
        interval=5,
        describe=lambda: get_isvc(apis, e2e, NAME).get("status"),
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

    wait_for(lambda: gone(lambda: get_isvc(apis, e2e, NAME)), 120, "the InferenceService to go")
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
