"""The chart's RBAC on a real kube-apiserver, as its own pods use it: sufficient (no call of the
operator or a router is refused) and least-privilege (every permission a Role or ClusterRole
grants them is used by some call).

The operator and the routers run as the chart deploys them, under their ServiceAccounts' tokens
alone (the kubelet stand-in's ImageRuntime), and every API call they make passes the recording
proxy (api_recorder). The test drives each operator handler (reconcile on create and update,
resync, the Deployment and Service events, the autoscaler's scrapes of the engine and router
pods, the wake from zero, the Tenant check with its Secret, the optional children created and
deleted: a PodDisruptionBudget and a NetworkPolicy; LoRA adapter sync, loading an adapter into
and unloading it from an engine that requires an API key, on a tiny random model) and each
router path (discovery of InferenceServices and pods, the wake of a service at zero, routing to
the woken replica, reading the engine key of a service whose engines require one and routing to
it with that key), then reads every call recorded in the session. The engine pods make no call
(no ServiceAccount token is mounted in them).

Needs the stand-ins (KVPILOT_E2E_KUBELET=standin; e2e/run-real-apiserver.sh): on a cluster
with nodes nothing records the pods' calls, and the test is skipped.
"""

from __future__ import annotations

import base64
import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpilot.contract.tenancy import TENANT_PLURAL

from .api_recorder import ApiCall, Permission, permissions, refused, unused
from .cluster import example_isvc, get_isvc, port_forward, wait_for
from .conftest import GROUP, PLURAL, VERSION, E2ESettings
from .lora_models import LoraModels, lora_models_for_pods, tiny_lora_spec
from .standin_cluster import StandinCluster

pytestmark = pytest.mark.k8s

NAME = "rbac"
TENANT = "rbac-team"
SECRET = "rbac-team-keys"
LORA = "rbac-lora"  # the InferenceService whose adapters the operator syncs
ENGINE_KEY = "rbac-engine-key"  # the Secret of its engines' API key
ADAPTER = "sql"
SCALE_TO_ZERO_AFTER_S = 20
# Granted for a check the API server makes, not for a call: with OwnerReferencesPermission-
# Enforcement on (OpenShift, hardened clusters), setting blockOwnerDeletion on a child needs
# `update` on the owner's finalizers.
# A 403 in a log line: not the milliseconds of a timestamp (",403"), nor part of an id.
FORBIDDEN_CODE = re.compile(r"(?<![\w,.:-])403(?![\w-])")
CHECKED_NOT_CALLED = {(GROUP, "inferenceservices/finalizers", "update")}


@pytest.fixture()
def stand_ins(standin: StandinCluster | None) -> StandinCluster:
    if standin is None:
        pytest.skip("needs the kubelet stand-ins' recording proxy (KVPILOT_E2E_KUBELET=standin)")
    return standin


@contextlib.contextmanager
def tenant_with_keys(apis: dict[str, Any], e2e: E2ESettings) -> Iterator[None]:
    from kubernetes import client

    key = base64.b64encode(b"sk-rbac-0123456789abcdef0123").decode()
    secret = client.V1Secret(metadata=client.V1ObjectMeta(name=SECRET), data={"ci": key})
    apis["core"].create_namespaced_secret(e2e.namespace, secret)
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Tenant",
        "metadata": {"name": TENANT, "namespace": e2e.namespace},
        "spec": {"apiKeys": [{"name": SECRET}]},
    }
    custom = apis["custom"]
    custom.create_namespaced_custom_object(GROUP, VERSION, e2e.namespace, TENANT_PLURAL, body)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            custom.delete_namespaced_custom_object(
                GROUP, VERSION, e2e.namespace, TENANT_PLURAL, TENANT
            )
        with contextlib.suppress(Exception):
            apis["core"].delete_namespaced_secret(SECRET, e2e.namespace)


@contextlib.contextmanager
def lora_service(apis: dict[str, Any], e2e: E2ESettings, models: LoraModels) -> Iterator[None]:
    """The tiny model with adapter ADAPTER, its engines requiring the key in Secret ENGINE_KEY:
    the operator reads the key to list, load and unload adapters."""
    from kubernetes import client

    key = base64.b64encode(b"sk-engine-0123456789abcdef0123").decode()
    secret = client.V1Secret(metadata=client.V1ObjectMeta(name=ENGINE_KEY), data={"api-key": key})
    apis["core"].create_namespaced_secret(e2e.namespace, secret)
    spec = tiny_lora_spec(models, max_loras=1)
    spec["engine"]["apiKeySecret"] = {"name": ENGINE_KEY}
    spec["adapters"] = [{"name": ADAPTER, "uri": f"file://{models.sql}"}]
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": LORA, "namespace": e2e.namespace},
        "spec": spec,
    }
    custom = apis["custom"]
    custom.create_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, body)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            custom.delete_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, LORA)
        with contextlib.suppress(Exception):
            apis["core"].delete_namespaced_secret(ENGINE_KEY, e2e.namespace)


def adapter_states(apis: dict[str, Any], e2e: E2ESettings) -> dict[str, list[str]]:
    """{adapter: [state of each replica]} from LORA's status (written by the operator)."""
    status = get_isvc(apis, e2e, LORA).get("status") or {}
    return {
        a["name"]: [r["state"] for r in a.get("replicas") or []]
        for a in status.get("adapters") or []
    }


@pytest.fixture(scope="module")
def lora_models() -> Iterator[LoraModels]:
    with lora_models_for_pods() as models:
        yield models


def granted(apis: dict[str, Any], account: str, namespaces: list[str]) -> list[Permission]:
    """What the installed bindings grant ServiceAccount `account` (namespace/name)."""
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(apis["core"].api_client)
    serialize = apis["core"].api_client.sanitize_for_serialization
    namespace, name = account.split("/")

    def binds(binding: Any) -> bool:
        return any(
            s.kind == "ServiceAccount" and s.name == name and s.namespace == namespace
            for s in binding.subjects or []
        )

    roles: dict[str, dict[str, Any]] = {}
    for binding in rbac.list_cluster_role_binding().items:
        if binds(binding):
            role = rbac.read_cluster_role(binding.role_ref.name)
            roles[f"ClusterRole/{role.metadata.name}"] = serialize(role)
    for where in namespaces:
        for binding in rbac.list_namespaced_role_binding(where).items:
            if not binds(binding):
                continue
            ref = binding.role_ref
            if ref.kind == "ClusterRole":
                role = rbac.read_cluster_role(ref.name)
            else:
                role = rbac.read_namespaced_role(ref.name, where)
            roles[f"{ref.kind}/{ref.name}"] = serialize(role)
    return [p for role in roles.values() for p in permissions(role)]


def test_the_operator_and_routers_use_every_permission_and_are_refused_none(
    release: str,
    e2e: E2ESettings,
    apis: dict[str, Any],
    stand_ins: StandinCluster,
    pod_logs: Callable[[str, str], str],
    lora_models: LoraModels,
) -> None:
    import httpx

    custom = apis["custom"]
    body = example_isvc(e2e, NAME)
    del body["spec"]["replicas"]
    # More than one replica possible: a PodDisruptionBudget; a NetworkPolicy; at zero until a
    # request wakes it.
    body["spec"]["autoscaling"] = {
        "minReplicas": 0,
        "maxReplicas": 2,
        "scaleToZeroAfterSeconds": SCALE_TO_ZERO_AFTER_S,
    }
    body["spec"]["networkPolicy"] = {}

    def children() -> tuple[bool, bool]:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        api = apis["core"].api_client
        found = []
        for read in (
            client.PolicyV1Api(api).read_namespaced_pod_disruption_budget,
            client.NetworkingV1Api(api).read_namespaced_network_policy,
        ):
            try:
                read(NAME, e2e.namespace)
                found.append(True)
            except ApiException as error:
                assert error.status == 404, error
                found.append(False)
        return found[0], found[1]

    with tenant_with_keys(apis, e2e), lora_service(apis, e2e, lora_models):
        custom.create_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, body)
        try:
            wait_for(lambda: children() == (True, True), 60, "the PDB and NetworkPolicy")
            # The router holds the request, asks for a wake; the operator scales to one.
            with port_forward(e2e.operator_namespace, "svc/kvpilot-router", 80) as port:
                answer = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={
                        "model": NAME,
                        "messages": [{"role": "user", "content": "Say hello."}],
                        "max_tokens": 4,
                    },
                    timeout=e2e.timeout_s,
                )
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] > 0

            def autoscaler_reads() -> bool:
                status = get_isvc(apis, e2e, NAME).get("status") or {}
                return (status.get("autoscaling") or {}).get("metrics", {}).get(
                    "reportingPods"
                ) == 1

            wait_for(autoscaler_reads, 60, "the autoscaler to scrape the engine", interval=1)
            tenant = custom.get_namespaced_custom_object(
                GROUP, VERSION, e2e.namespace, TENANT_PLURAL, TENANT
            )
            assert (tenant.get("status") or {}).get("keys") == 1, tenant.get("status")

            # An update: one replica at most and no NetworkPolicy: both optional children go.
            patch = {"spec": {"autoscaling": {"maxReplicas": 1}, "networkPolicy": None}}
            custom.patch_namespaced_custom_object(
                GROUP, VERSION, e2e.namespace, PLURAL, NAME, patch
            )
            wait_for(lambda: children() == (False, False), 60, "the PDB and NetworkPolicy to go")

            # Adapter sync: loaded into the tiny model's replica, then unloaded when the spec
            # drops it (the operator reads the engines' key, lists its pods, writes status).
            wait_for(
                lambda: adapter_states(apis, e2e) == {ADAPTER: ["Loaded"]},
                e2e.timeout_s,
                f"{ADAPTER} Loaded in {LORA}",
                describe=lambda: (get_isvc(apis, e2e, LORA).get("status"), stand_ins.errors()),
            )
            # The routers read LORA's engine key from its Secret (under their own
            # ServiceAccount) and send it: its engine refuses the block events and the
            # request without it.
            with port_forward(e2e.operator_namespace, "svc/kvpilot-router", 80) as port:
                keyed = httpx.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"model": LORA, "prompt": [1, 2, 3], "max_tokens": 1},
                    timeout=e2e.timeout_s,
                )
            assert keyed.status_code == 200, keyed.text
            assert keyed.headers["x-kvpilot-replica"].startswith(LORA)
            custom.patch_namespaced_custom_object(
                GROUP, VERSION, e2e.namespace, PLURAL, LORA, {"spec": {"adapters": []}}
            )
            wait_for(lambda: adapter_states(apis, e2e) == {}, 60, f"{ADAPTER} to be unloaded")
        finally:
            with contextlib.suppress(Exception):
                custom.delete_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, NAME)

    namespaces = [e2e.namespace, e2e.operator_namespace]
    report: dict[str, Any] = {}
    for account in (
        f"{e2e.operator_namespace}/kvpilot",
        f"{e2e.operator_namespace}/kvpilot-router",
    ):
        calls: list[ApiCall] = stand_ins.recorder.calls_of(account)
        assert calls, f"no call recorded for {account}"
        never = [
            p
            for p in unused(granted(apis, account, namespaces), calls)
            if (p.group, p.resource, p.verb) not in CHECKED_NOT_CALLED
        ]
        report[account] = {"refused": refused(calls), "unused": never}
    assert all(not r["refused"] and not r["unused"] for r in report.values()), report
    # No other pod called the API: the engines have no ServiceAccount token.
    others = {call.who for call in stand_ins.recorder.calls} - set(report)
    assert not others, others

    # Nor did anything else they called answer Forbidden (their logs say so where it happens).
    selector = "app.kubernetes.io/part-of=kvpilot"
    pods = apis["core"].list_namespaced_pod(e2e.operator_namespace, label_selector=selector)
    assert len(pods.items) == 3  # the operator and two routers
    for pod in pods.items:
        log = pod_logs(e2e.operator_namespace, pod.metadata.name)
        assert "Forbidden" not in log and not FORBIDDEN_CODE.search(log), pod.metadata.name
