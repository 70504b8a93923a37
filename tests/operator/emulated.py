"""Talking to kmock's emulator as the rest of the cluster does: the test's own requests, and
views of what the operator wrote (the emulator keeps every request for the RBAC check).
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator.conditions import find_condition

from .conftest import ISVC_PATH, NAMESPACE
from .kube_emulator import KubeEmulator

ISVC = "kvpilot.dev/v1alpha1/inferenceservices"
DEPLOYMENT = "apps/v1/deployments"
SERVICE = "v1/services"
MERGE = {"Content-Type": "application/merge-patch+json"}


async def api(kmock: KubeEmulator, method: str, path: str, body: Any = None) -> dict[str, Any]:
    headers = MERGE if method == "PATCH" else {}
    response = await kmock.request(method, path, json=body, headers=headers)
    assert response.status < 300, (response.status, await response.text())
    return await response.json()


async def create_isvc(kmock: KubeEmulator, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }
    return await api(kmock, "POST", ISVC_PATH, body)


def live(kmock: KubeEmulator, resource: str, name: str) -> dict[str, Any] | None:
    key = (kmock.resource(resource), NAMESPACE, name)
    if key not in kmock.objects or kmock.objects[key].deleted:
        return None
    return kmock.objects[key].raw


def condition(kmock: KubeEmulator, name: str, type_: str) -> tuple[str, str, str] | None:
    obj = live(kmock, ISVC, name) or {}
    found = find_condition((obj.get("status") or {}).get("conditions") or [], type_)
    return None if found is None else (found["status"], found["reason"], found["message"])


def events(kmock: KubeEmulator, name: str) -> list[dict[str, Any]]:
    found = []
    for (resource, _, _), obj in list(kmock.objects.items()):
        is_event = resource == kmock.resource("v1/events") and not obj.deleted
        if is_event and obj.raw.get("involvedObject", {}).get("name") == name:
            found.append(obj.raw)
    return found


def reasons(kmock: KubeEmulator, name: str) -> list[str]:
    return [event["reason"] for event in events(kmock, name)]


def engine_args(deployment: dict[str, Any]) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def rbac_call(request: Any) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) of a request the operator made; None for the
    test's own requests and for discovery (open to every authenticated client)."""
    if request.headers.get("User-Agent", "").startswith("kmock/"):
        return None
    resource = request.resource
    if resource is None or not resource.plural or request.action is None:
        return None
    verb = {
        "list": "list",
        "watch": "watch",
        "fetch": "get",
        "create": "create",
        "update": "patch" if request.method == "PATCH" else "update",
        "delete": "delete",
    }[request.action.value.lower()]
    plural = f"{resource.plural}/{request.subresource}" if request.subresource else resource.plural
    return (resource.group, plural, verb)


def status_writes(kmock: KubeEmulator, name: str) -> int:
    path = f"{ISVC_PATH}/{name}/status"
    return sum(1 for r in kmock._requests if r.method == "PATCH" and r.url.path == path)
