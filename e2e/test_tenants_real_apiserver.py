"""Tenants on a real kube-apiserver: the Tenant CRD as crds/ ships it refuses what its schema
and CEL rules refuse (422: a weight out of bounds, an unknown priority class, a model quota or a
Secret named twice), and the real operator (kopf and our handlers, in-process, watching a
namespace of its own) makes a Tenant Ready with its keys counted once its Secret exists, with a
Warning Event while it does not; `kubectl get tenants` columns read the status it writes.

Needs KUBECONFIG pointing at a control plane (no node needed); on this machine see
../shared/k8s-local/README.md: `K8S_FRESH=1 ~/.cache/k8s-local/up.sh`, then
`KUBECONFIG=~/.cache/k8s-local/kubeconfig pytest e2e/test_tenants_real_apiserver.py`.
"""

from __future__ import annotations

import base64
import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from kvpilot.contract.tenancy import TENANT_PLURAL
from kvpilot.operator.cli import run_operator
from kvpilot.operator.conditions import find_condition
from kvpilot.operator.config import OperatorConfig

from .cluster import wait_for
from .conftest import GROUP, PLURAL, ROOT, VERSION

pytestmark = pytest.mark.k8s

CRD_NAMES = (f"{PLURAL}.{GROUP}", f"{TENANT_PLURAL}.{GROUP}")
CHECK_S = 1.0
KEYS = {"ci": "sk-e2e-0123456789abcdef0123", "web": "sk-e2e-fedcba9876543210fedc"}


@pytest.fixture(scope="module")
def crds(apis: dict[str, Any]) -> Iterator[None]:
    """crds/ as shipped (both: the operator watches InferenceServices and Tenants); removed
    after the module's tests where it installed them."""
    ext = apis["ext"]
    installed = []
    for name in CRD_NAMES:
        body = yaml.safe_load((ROOT / "crds" / f"{name}.yaml").read_text())
        try:
            existing = ext.read_custom_resource_definition(name)
        except ApiException as error:
            if error.status != 404:
                raise
            ext.create_custom_resource_definition(body)
            installed.append(name)
        else:
            body["metadata"]["resourceVersion"] = existing.metadata.resource_version
            ext.replace_custom_resource_definition(name, body)

    def established() -> bool:
        for name in CRD_NAMES:
            conditions = ext.read_custom_resource_definition(name).status.conditions or []
            if not any(c.type == "Established" and c.status == "True" for c in conditions):
                return False
        return True

    wait_for(established, 30, "the CRDs to be Established", interval=0.2)
    yield
    for name in installed:
        ext.delete_custom_resource_definition(name)


@pytest.fixture()
def namespace(apis: dict[str, Any]) -> Iterator[str]:
    from kubernetes import client

    name = f"kvpilot-tenants-{uuid.uuid4().hex[:6]}"
    apis["core"].create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    apis["core"].delete_namespace(name)


@pytest.fixture()
def operator(apis: dict[str, Any], crds: None, namespace: str) -> Iterator[OperatorConfig]:
    config = OperatorConfig(
        namespaces=(namespace,),
        engine_image="kvpilot:unused",
        liveness_endpoint=None,
        metrics_port=0,
        tenant_check_seconds=CHECK_S,
    )
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=run_operator,
        args=(config,),
        kwargs={"stop_flag": stop, "ready_flag": ready},
        daemon=True,
    )
    thread.start()
    assert ready.wait(30), "the operator did not get ready"
    try:
        yield config
    finally:
        # The timer's finalizer goes with the Tenant only while the operator runs.
        custom = apis["custom"]
        with contextlib.suppress(ApiException):
            custom.delete_collection_namespaced_custom_object(
                GROUP, VERSION, namespace, TENANT_PLURAL
            )
        with contextlib.suppress(AssertionError):
            wait_for(
                lambda: (
                    not custom.list_namespaced_custom_object(
                        GROUP, VERSION, namespace, TENANT_PLURAL
                    )["items"]
                ),
                30,
                "the Tenants to go",
                interval=0.2,
            )
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), "the operator did not stop"


def tenant(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Tenant",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def create_tenant(apis: dict[str, Any], namespace: str, name: str, spec: dict[str, Any]) -> None:
    apis["custom"].create_namespaced_custom_object(
        GROUP, VERSION, namespace, TENANT_PLURAL, tenant(namespace, name, spec)
    )


def ready(apis: dict[str, Any], namespace: str, name: str) -> dict[str, Any]:
    body = apis["custom"].get_namespaced_custom_object(
        GROUP, VERSION, namespace, TENANT_PLURAL, name
    )
    return find_condition((body.get("status") or {}).get("conditions") or [], "Ready") or {}


def event_reasons(apis: dict[str, Any], namespace: str, name: str) -> dict[str, str]:
    events = apis["core"].list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}"
    )
    return {event.reason: event.type for event in events.items}


BAD = [
    ({"weight": 0}, "spec.weight"),
    ({"weight": 1001}, "spec.weight"),
    ({"priorityClass": "gold"}, "spec.priorityClass"),
    ({"modelQuotas": [{"model": "chat"}, {"model": "chat"}]}, "spec.modelQuotas"),
    ({"apiKeys": [{"name": "keys"}, {"name": "keys"}]}, "named twice"),
]


@pytest.mark.parametrize(("fields", "words"), BAD, ids=[w for _, w in BAD])
def test_the_api_server_refuses_a_bad_tenant(
    apis: dict[str, Any], crds: None, namespace: str, fields: dict[str, Any], words: str
) -> None:
    spec = {"apiKeys": [{"name": "keys"}], **fields}
    with pytest.raises(ApiException) as refused:
        create_tenant(apis, namespace, "bad", spec)
    assert refused.value.status == 422
    assert words in refused.value.body


def test_a_tenant_is_ready_with_its_keys_counted_once_its_secret_exists(
    apis: dict[str, Any], operator: OperatorConfig, namespace: str
) -> None:
    from kubernetes import client

    create_tenant(apis, namespace, "team-a", {"apiKeys": [{"name": "team-a-keys"}]})
    wait_for(
        lambda: ready(apis, namespace, "team-a").get("reason") == "NoApiKeys",
        30,
        "the Tenant to say it has no key",
        interval=0.2,
    )
    assert ready(apis, namespace, "team-a")["status"] == "False"
    wait_for(
        lambda: event_reasons(apis, namespace, "team-a").get("SecretNotFound") == "Warning",
        30,
        "a Warning Event about the missing Secret",
        interval=0.2,
    )

    data = {key: base64.b64encode(value.encode()).decode() for key, value in KEYS.items()}
    secret = client.V1Secret(metadata=client.V1ObjectMeta(name="team-a-keys"), data=data)
    apis["core"].create_namespaced_secret(namespace, secret)
    wait_for(
        lambda: ready(apis, namespace, "team-a").get("status") == "True",
        30,
        "the Tenant to be Ready (the timer sees the Secret)",
        interval=0.2,
    )
    body = apis["custom"].get_namespaced_custom_object(
        GROUP, VERSION, namespace, TENANT_PLURAL, "team-a"
    )
    assert body["status"]["keys"] == len(KEYS)
    assert ready(apis, namespace, "team-a")["reason"] == "KeysFound"
    shown = str(body) + str(apis["core"].list_namespaced_event(namespace))
    assert not any(key in shown for key in KEYS.values())
