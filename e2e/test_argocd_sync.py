"""On a real cluster: an Argo CD-style sync of the autoscaled CPU example, twice, with the
autoscaler at work in between, shows no diff, and Argo CD's health check (the chart's Lua, in a
real Lua interpreter) reads the live object as Healthy.

Argo CD's server-side diff is a server-side dry-run apply of the Git manifest with its own field
manager, compared with the live object: if the operator or its autoscaler wrote any field the
manifest sets (the spec), the dry run would put it back and the app would be OutOfSync.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from .cluster import get_isvc, wait_for, wait_ready
from .conftest import CHART, GROUP, PLURAL, ROOT, VERSION, E2ESettings

pytestmark = pytest.mark.k8s

EXAMPLE = ROOT / "examples" / "smollm2-cpu-autoscaling.yaml"
NAME = "argo-auto"
ARGO_MANAGER = "argocd-controller"
# What Argo CD's diff ignores on every object: bookkeeping the server or controllers own.
IGNORED_METADATA = ("managedFields", "resourceVersion", "generation", "uid", "creationTimestamp")


def manifest(e2e: E2ESettings) -> dict[str, Any]:
    """The example as it sits in Git, with the label Argo CD tracks its resources by."""
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {
        "name": NAME,
        "namespace": e2e.namespace,
        "labels": {"app.kubernetes.io/instance": "kvpilot-demo"},
    }
    return body


def apply(apis: dict[str, Any], body: dict[str, Any], *, dry_run: bool) -> dict[str, Any]:
    """A server-side apply as Argo CD's ServerSideApply=true sync (and its diff) does."""
    options: dict[str, Any] = {"dry_run": "All"} if dry_run else {}
    # Read raw: the client deserializes only a 200, and the apply that creates answers 201.
    response = apis["custom"].patch_namespaced_custom_object(
        GROUP,
        VERSION,
        body["metadata"]["namespace"],
        PLURAL,
        NAME,
        body,
        field_manager=ARGO_MANAGER,
        force=True,
        _content_type="application/apply-patch+yaml",
        _preload_content=False,
        **options,
    )
    return dict(json.loads(response.data))


def comparable(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj.pop("status", None)
    for key in IGNORED_METADATA:
        obj["metadata"].pop(key, None)
    return obj


def argocd_diff(apis: dict[str, Any], e2e: E2ESettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what a sync would make of the object, the object): equal means Synced."""
    predicted = apply(apis, manifest(e2e), dry_run=True)
    return comparable(predicted), comparable(get_isvc(apis, e2e, NAME))


def argocd_health(obj: dict[str, Any]) -> tuple[str, str]:
    from lupa import lua51

    lua = lua51.LuaRuntime()
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute((CHART / "files" / "argocd-health.lua").read_text())
    return result["status"], result["message"]


@pytest.fixture(scope="module")
def synced(release: str, e2e: E2ESettings, apis: dict[str, Any]) -> Iterator[dict[str, Any]]:
    first = apply(apis, manifest(e2e), dry_run=False)  # sync 1 creates it
    yield first
    with contextlib.suppress(Exception):
        apis["custom"].delete_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, NAME)


def test_a_second_sync_with_the_autoscaler_at_work_changes_nothing(
    synced: dict[str, Any], e2e: E2ESettings, apis: dict[str, Any]
) -> None:
    generation = synced["metadata"]["generation"]
    wait_ready(apis, e2e, NAME)

    def autoscaling() -> dict[str, Any]:
        return (get_isvc(apis, e2e, NAME).get("status") or {}).get("autoscaling") or {}

    # The autoscaler is at work: it reads the engine and has decided a few times since.
    wait_for(
        lambda: autoscaling().get("metrics", {}).get("reportingPods") == 1,
        120,
        "the autoscaler to read the engine's metrics",
        describe=autoscaling,
    )
    first_tick = autoscaling()["observedAt"]
    wait_for(
        lambda: autoscaling().get("observedAt") != first_tick,
        60,
        "another autoscaler tick",
        describe=autoscaling,
    )
    deployment = apis["apps"].read_namespaced_deployment(NAME, e2e.namespace)
    deployment_generation = deployment.metadata.generation

    predicted, live = argocd_diff(apis, e2e)
    assert predicted == live, "Argo CD would show this InferenceService OutOfSync"
    obj = get_isvc(apis, e2e, NAME)
    assert obj["metadata"]["generation"] == generation  # nobody wrote the spec
    assert argocd_health(obj)[0] == "Healthy", argocd_health(obj)

    # Sync 2: the same manifest again is a no-op for the spec and for the engine pods (the
    # resourceVersion moves anyway with every status write of the autoscaler).
    second = apply(apis, manifest(e2e), dry_run=False)
    assert second["metadata"]["generation"] == generation
    again = apis["apps"].read_namespaced_deployment(NAME, e2e.namespace)
    assert again.metadata.generation == deployment_generation  # no rollout
    predicted, live = argocd_diff(apis, e2e)
    assert predicted == live
