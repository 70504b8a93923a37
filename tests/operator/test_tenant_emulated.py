"""The real operator (kopf + our handlers) checking Tenants against kmock's emulator: a missing
Secret, then the Secret created (the timer sees it), keys counted and never shown, a spec that
cannot work (InvalidSpec, one Event per problem, no retry storm), no permission to read Secrets,
grants that match no served model, and the routers' status.usage left alone."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from typing import Any

import pytest

from kvpilot.operator.conditions import find_condition
from kvpilot.operator.config import OperatorConfig

from .chart import operator_rules, rbac_allows
from .conftest import NAMESPACE, RunningOperator, eventually
from .emulated import api, create_isvc, events, live, rbac_call
from .kube_emulator import KubeEmulator

pytestmark = pytest.mark.kmock(cls=KubeEmulator)

TENANTS = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/tenants"
SECRETS = f"/api/v1/namespaces/{NAMESPACE}/secrets"
TENANT = "kvpilot.dev/v1alpha1/tenants"
CHECK_S = 0.5
KEY_A, KEY_B = "sk-team-a-0123456789abcdef", "sk-team-a-fedcba9876543210"


@pytest.fixture()
def operator_config(operator_config: OperatorConfig) -> OperatorConfig:
    return dataclasses.replace(operator_config, tenant_check_seconds=CHECK_S)


async def create_tenant(kmock: KubeEmulator, name: str, spec: dict[str, Any]) -> None:
    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }
    await api(kmock, "POST", TENANTS, body)


async def create_secret(kmock: KubeEmulator, name: str, data: dict[str, str]) -> None:
    encoded = {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": encoded}
    await api(kmock, "POST", SECRETS, body)


def status(kmock: KubeEmulator, name: str) -> dict[str, Any]:
    return (live(kmock, TENANT, name) or {}).get("status") or {}


def ready(kmock: KubeEmulator, name: str) -> tuple[str, str, str] | None:
    found = find_condition(status(kmock, name).get("conditions") or [], "Ready")
    return None if found is None else (found["status"], found["reason"], found["message"])


def ready_is(kmock: KubeEmulator, name: str, status_or_reason: str) -> bool:
    return status_or_reason in (ready(kmock, name) or ())[:2]


def warnings(kmock: KubeEmulator, name: str) -> list[tuple[str, str]]:
    return [(e["reason"], e["message"]) for e in events(kmock, name) if e["type"] == "Warning"]


def status_writes(kmock: KubeEmulator, name: str) -> int:
    path = f"{TENANTS}/{name}/status"
    return sum(1 for r in kmock._requests if r.method == "PATCH" and r.url.path == path)


@pytest.mark.usefixtures("operator")
async def test_a_secret_created_later_makes_the_tenant_ready_with_its_keys_counted(
    kmock: KubeEmulator,
) -> None:
    await create_isvc(kmock, "chat", {"model": {"uri": "builtin://smollm2-135m-instruct"}})
    spec = {
        "apiKeys": [{"name": "team-a-keys"}, {"name": "team-a-extra", "key": "rotated"}],
        "models": ["chat", "llama-*"],
    }
    await create_tenant(kmock, "team-a", spec)
    await eventually(lambda: ready_is(kmock, "team-a", "NoApiKeys"))
    assert ready(kmock, "team-a")[0] == "False"  # type: ignore[index]
    message = ready(kmock, "team-a")[2]  # type: ignore[index]
    assert "Secret team-a-keys not found" in message
    assert "models grant 'llama-*' matches no model id" in message
    assert "'chat'" not in message  # the served InferenceService matches its grant
    await eventually(lambda: ("SecretNotFound", "Secret team-a-keys not found") in warnings(
        kmock, "team-a"
    ))  # fmt: skip
    await eventually(lambda: "GrantMatchesNoModel" in dict(warnings(kmock, "team-a")))

    # Created after the Tenant: nothing about the Tenant changes, the timer finds it.
    await create_secret(kmock, "team-a-keys", {"old": KEY_A, "new": KEY_B, "blank": " \n"})
    await eventually(lambda: ready_is(kmock, "team-a", "True"), timeout=10)
    assert status(kmock, "team-a")["keys"] == 2  # the blank entry holds no key
    _, reason, message = ready(kmock, "team-a")  # type: ignore[misc]
    assert reason == "KeysFound"
    assert message.startswith("2 API keys in Secret(s) team-a-keys, team-a-extra")
    assert "Secret team-a-extra not found" in message
    await eventually(lambda: "KeysFound" in [e["reason"] for e in events(kmock, "team-a")])

    # The keyed entry of the second Secret counts once it holds a value.
    await create_secret(kmock, "team-a-extra", {"rotated": KEY_A, "other": KEY_B})
    await eventually(lambda: status(kmock, "team-a").get("keys") == 3, timeout=10)

    # A router's usage survives the operator's writes (a merge patch of its own keys only).
    usage = {"windowStart": "2026-01-01T00:00:00Z", "requests": 7, "tokens": 700}
    await api(kmock, "PATCH", f"{TENANTS}/team-a/status", {"status": {"usage": usage}})
    await api(kmock, "PATCH", f"{SECRETS}/team-a-keys", {"data": {"old": None}})
    await eventually(lambda: status(kmock, "team-a").get("keys") == 2, timeout=10)
    assert status(kmock, "team-a")["usage"] == usage

    shown = str(live(kmock, TENANT, "team-a")) + str(events(kmock, "team-a"))
    assert KEY_A not in shown and KEY_B not in shown
    assert base64.b64encode(KEY_A.encode()).decode() not in shown

    # Every call it made (kopf's on Tenants included) is in the chart's ClusterRole.
    rules = operator_rules({"rbac": {"readApiKeySecrets": True}})
    calls = {call for call in map(rbac_call, kmock._requests) if call is not None}
    assert {("kvpilot.dev", "tenants/status", "patch"), ("", "secrets", "get")} <= calls
    assert [call for call in calls if not rbac_allows(rules, *call)] == []


async def test_an_invalid_spec_is_invalidspec_once_without_a_retry_storm(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    spec = {"apiKeys": [{"name": "k"}], "priorityClass": "gold", "weight": 0}
    await create_tenant(kmock, "bad", spec)
    await eventually(lambda: ready(kmock, "bad"))
    status_, reason, message = ready(kmock, "bad")  # type: ignore[misc]
    assert (status_, reason) == ("False", "InvalidSpec")
    assert "spec.priorityClass" in message and "spec.weight" in message
    await eventually(lambda: len(warnings(kmock, "bad")) == 2)  # one Event per problem
    writes = status_writes(kmock, "bad")
    await asyncio.sleep(4 * CHECK_S)  # several timer rounds
    assert status_writes(kmock, "bad") == writes
    assert len(warnings(kmock, "bad")) == 2
    assert operator.thread.is_alive()

    # Fixed: Ready follows (the Secret is still missing: NoApiKeys, a new problem).
    await api(kmock, "PATCH", f"{TENANTS}/bad", {"spec": {"priorityClass": "high", "weight": 3}})
    await eventually(lambda: ready_is(kmock, "bad", "NoApiKeys"))
    await eventually(lambda: "SecretNotFound" in dict(warnings(kmock, "bad")))


@pytest.mark.usefixtures("operator")
async def test_without_permission_to_read_secrets_the_keys_are_not_checked(
    kmock: KubeEmulator,
) -> None:
    kmock.inject_fault(
        lambda r: r.method == "GET" and r.url.path.startswith(SECRETS), 403, count=1000
    )
    await create_tenant(kmock, "team-b", {"apiKeys": [{"name": "team-b-keys"}], "models": ["*"]})
    await eventually(lambda: ready(kmock, "team-b"))
    status_, reason, message = ready(kmock, "team-b")  # type: ignore[misc]
    assert (status_, reason) == ("True", "KeysNotChecked")
    assert "rbac.readApiKeySecrets=true" in message
    assert "keys" not in status(kmock, "team-b")
