"""The chart's Argo CD health check (Lua), run in a real Lua 5.1 interpreter (Argo CD's gopher-lua
speaks 5.1) against statuses made by the operator's own status builder, one per condition."""

from __future__ import annotations

import copy
import datetime
from typing import Any

import pytest
import yaml
from lupa import lua51

from kvpilot.operator.conditions import find_condition
from kvpilot.operator.status import (
    Observed,
    build_blocked_status,
    build_invalid_status,
    build_status,
)

from .chart import of_kind, render
from .test_diagnose import CRASH_LOOP, DOWNLOAD_FAILED, HEALTHY, OOM, UNSCHEDULABLE

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
GENERATION = 4
HEALTH_KEY = "resource.customizations.health.kvpilot.dev_InferenceService"


def health_script() -> str:
    """The Lua the chart ships, read back from the rendered argocd-cm patch."""
    docs = render({"argocd": {"healthCheck": {"enabled": True, "namespace": "gitops"}}})
    (config_map,) = [
        d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-argocd-health")
    ]
    assert config_map["metadata"]["namespace"] == "gitops"
    patch = yaml.safe_load(config_map["data"]["argocd-cm-patch.yaml"])
    return patch["data"][HEALTH_KEY]


SCRIPT = health_script()


def argocd_health(obj: dict[str, Any]) -> tuple[str, str]:
    """What Argo CD does: a global `obj`, the script's returned table."""
    lua = lua51.LuaRuntime()
    lua.globals().obj = lua.table_from(copy.deepcopy(obj), recursive=True)
    result = lua.execute(SCRIPT)
    return result["status"], result["message"]


def isvc(status: dict[str, Any] | None, generation: int = GENERATION) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "serving", "generation": generation},
        "spec": {"model": {"uri": "builtin://smollm2-135m-instruct"}},
    }
    if status is not None:
        obj["status"] = status
    return obj


def deployment(replicas: int, ready: int, updated: int | None = None) -> dict[str, Any]:
    updated = replicas if updated is None else updated
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": updated,
        },
    }


def built(dep: dict[str, Any], pods: list[dict[str, Any]], desired: int = 2) -> dict[str, Any]:
    observed = Observed(
        generation=GENERATION,
        deployment=dep,
        pods=pods,
        desired_replicas=desired,
        selector="app.kubernetes.io/instance=chat",
        url="http://chat.serving.svc:8000/v1",
        model="chat",
    )
    return build_status({}, observed, NOW)


def described(status: dict[str, Any], type_: str) -> str:
    condition = find_condition(status["conditions"], type_)
    assert condition is not None
    return f"{condition['reason']}: {condition['message']}"


def test_no_status_yet_is_progressing() -> None:
    assert argocd_health(isvc(None)) == (
        "Progressing",
        "Waiting for the kvpilot operator to report status",
    )


def test_a_status_for_an_older_generation_is_progressing() -> None:
    status = built(deployment(2, 2), [HEALTHY, HEALTHY])  # Ready, for generation 4
    assert argocd_health(isvc(status))[0] == "Healthy"
    assert argocd_health(isvc(status, generation=GENERATION + 1)) == (
        "Progressing",
        f"Waiting for the kvpilot operator to observe generation {GENERATION + 1}",
    )


@pytest.mark.parametrize(
    ("dep", "pods"),
    [(deployment(0, 0), []), (deployment(2, 1, updated=1), [HEALTHY])],
    ids=["first-replicas-starting", "scaling-up-while-serving"],
)
def test_replicas_coming_up_are_progressing(dep: dict[str, Any], pods: list[dict]) -> None:
    status = built(dep, pods)
    health, message = argocd_health(isvc(status))
    assert health == "Progressing"
    assert message == described(status, "Reconciling")
    assert message.startswith("RollingOut: ")


def test_ready_is_healthy() -> None:
    status = built(deployment(2, 2), [HEALTHY, HEALTHY])
    assert argocd_health(isvc(status)) == ("Healthy", "Serving: 2/2 replica(s) ready")


def test_scaled_to_zero_is_suspended() -> None:
    status = built(deployment(0, 0), [], desired=0)
    assert argocd_health(isvc(status)) == (
        "Suspended",
        "ScaledToZero: replicas is 0: nothing serves requests",
    )


@pytest.mark.parametrize(
    ("pod", "reason"),
    [
        (CRASH_LOOP, "CrashLoopBackOff"),
        (OOM, "OOMKilled"),
        (DOWNLOAD_FAILED, "ModelDownloadFailed"),
        (UNSCHEDULABLE, "Unschedulable"),
    ],
)
def test_pod_problems_are_degraded_with_the_conditions_message(
    pod: dict[str, Any], reason: str
) -> None:
    status = built(deployment(1, 0), [pod], desired=1)
    health, message = argocd_health(isvc(status))
    assert health == "Degraded"
    assert message == described(status, "Degraded")
    assert message.startswith(f"{reason}: ") and len(message) > len(reason) + 2


def test_invalid_spec_is_degraded_with_its_message() -> None:
    message = "spec.autoscaling: minReplicas (3) must be <= maxReplicas (2)"
    status = build_invalid_status({}, GENERATION, message, NOW)
    assert argocd_health(isvc(status)) == ("Degraded", f"InvalidSpec: {message}")


def test_an_invalid_spec_keeps_reporting_degraded_over_a_serving_status() -> None:
    serving = built(deployment(2, 2), [HEALTHY, HEALTHY])
    status = build_invalid_status(serving, GENERATION, "spec.engine.blockSize: bad", NOW)
    assert argocd_health(isvc(status)) == ("Degraded", "InvalidSpec: spec.engine.blockSize: bad")


def test_ownership_conflict_is_degraded() -> None:
    status = build_blocked_status({}, GENERATION, "OwnershipConflict", "a Deployment ...", NOW)
    assert argocd_health(isvc(status)) == ("Degraded", "OwnershipConflict: a Deployment ...")
