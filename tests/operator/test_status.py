from __future__ import annotations

import datetime
from typing import Any

from kvpilot.operator.conditions import find_condition
from kvpilot.operator.status import (
    OWNED_KEYS,
    Observed,
    build_blocked_status,
    build_invalid_status,
    build_status,
)

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
T1 = T0 + datetime.timedelta(seconds=30)


def deployment(generation: int = 1, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": generation, **status},
    }


def observe(
    dep: dict[str, Any] | None, pods: list[dict[str, Any]] | None = None, **kw: Any
) -> Observed:
    fields = {
        "generation": 4,
        "deployment": dep,
        "pods": pods or [],
        "desired_replicas": 2,
        "selector": "app.kubernetes.io/name=kvpilot-engine,app.kubernetes.io/instance=chat",
        "url": "http://chat.serving.svc:8000/v1",
        "model": "chat",
    }
    return Observed(**{**fields, **kw})


def summary(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Ready, Progressing and Degraded; kstatus' Reconciling and Stalled must mirror the latter
    two (status, reason and message) in every status built."""
    by_type = {c["type"]: c for c in status["conditions"]}
    for ours, kstatus in (("Progressing", "Reconciling"), ("Degraded", "Stalled")):
        mirrored = {k: v for k, v in by_type.pop(kstatus).items() if k != "type"}
        assert mirrored == {k: v for k, v in by_type[ours].items() if k != "type"}, kstatus
    return {t: (c["status"], c["reason"]) for t, c in by_type.items()}


def test_new_deployment_is_progressing_not_ready() -> None:
    status = build_status({}, observe(deployment()), T0)
    assert summary(status) == {
        "Ready": ("False", "WaitingForReplicas"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("False", "AsExpected"),
    }
    assert status["observedGeneration"] == 4
    assert all(c["observedGeneration"] == 4 for c in status["conditions"])
    assert status["url"] == "http://chat.serving.svc:8000/v1"
    assert status["model"] == "chat"
    assert status["selector"].endswith("instance=chat")
    assert (status["replicas"], status["readyReplicas"], status["desiredReplicas"]) == (0, 0, 2)
    assert set(status) <= set(OWNED_KEYS)


def test_rolled_out_and_serving() -> None:
    dep = deployment(replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2)
    status = build_status({}, observe(dep), T0)
    assert summary(status) == {
        "Ready": ("True", "Serving"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert status["readyReplicas"] == 2


def test_rollout_in_progress_still_serves_from_old_pods() -> None:
    dep = deployment(replicas=3, readyReplicas=2, updatedReplicas=1, availableReplicas=2)
    assert summary(build_status({}, observe(dep), T0))["Ready"] == ("True", "Serving")
    assert summary(build_status({}, observe(dep), T0))["Progressing"] == ("True", "RollingOut")


def test_a_deployment_not_yet_observed_is_still_progressing() -> None:
    dep = deployment(replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2)
    dep["metadata"]["generation"] = 2  # the spec changed, the controller has not seen it yet
    assert summary(build_status({}, observe(dep), T0))["Progressing"] == ("True", "RollingOut")


def test_a_crash_looping_pod_is_degraded_and_explains_not_ready() -> None:
    crashing = {
        "metadata": {"name": "chat-abc"},
        "status": {
            "containerStatuses": [
                {
                    "name": "engine",
                    "restartCount": 3,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1, "message": "boom"}},
                }
            ]
        },
    }
    status = build_status({}, observe(deployment(replicas=1), [crashing]), T0)
    assert summary(status)["Degraded"] == ("True", "CrashLoopBackOff")
    assert summary(status)["Ready"] == ("False", "CrashLoopBackOff")
    degraded = find_condition(status["conditions"], "Degraded")
    assert (
        degraded is not None and "chat-abc" in degraded["message"] and "boom" in degraded["message"]
    )


def test_progress_deadline_exceeded_is_degraded() -> None:
    dep = deployment(
        replicas=2,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": 'ReplicaSet "chat-1" has timed out progressing.',
            }
        ],
    )
    status = build_status({}, observe(dep), T0)
    assert summary(status) == {
        "Ready": ("False", "ProgressDeadlineExceeded"),
        "Progressing": ("False", "ProgressDeadlineExceeded"),
        "Degraded": ("True", "ProgressDeadlineExceeded"),
    }


def test_replica_failure_is_degraded() -> None:
    dep = deployment(
        conditions=[
            {
                "type": "ReplicaFailure",
                "status": "True",
                "reason": "FailedCreate",
                "message": "exceeded quota: gpus",
            }
        ]
    )
    status = build_status({}, observe(dep), T0)
    assert summary(status)["Degraded"] == ("True", "ReplicaFailure")
    degraded = find_condition(status["conditions"], "Degraded")
    assert degraded is not None and degraded["message"] == "exceeded quota: gpus"


def test_zero_replicas_is_not_ready() -> None:
    status = build_status({}, observe(deployment(), desired_replicas=0), T0)
    assert summary(status)["Ready"] == ("False", "ScaledToZero")
    assert summary(status)["Progressing"] == ("False", "RolloutComplete")


def test_transition_times_survive_a_status_refresh() -> None:
    first = build_status({}, observe(deployment()), T0)
    dep = deployment(replicas=2, readyReplicas=1, updatedReplicas=2, availableReplicas=1)
    second = build_status(first, observe(dep), T1)
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times["Ready"] == "2026-01-01T00:00:30Z"  # flipped to True
    assert times["Degraded"] == "2026-01-01T00:00:00Z"  # still False


def test_invalid_spec_keeps_the_last_observed_numbers() -> None:
    serving = build_status(
        {},
        observe(deployment(replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2)),
        T0,
    )
    status = build_invalid_status({**serving, "autoscaling": {"x": 1}}, 5, "spec.replicas: bad", T1)
    assert summary(status) == {
        "Ready": ("False", "InvalidSpec"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }
    assert status["observedGeneration"] == 5
    assert status["readyReplicas"] == 2
    assert "autoscaling" not in status  # not ours to write
    ready = find_condition(status["conditions"], "Ready")
    assert ready is not None and ready["message"] == "spec.replicas: bad"


def test_blocked_status_names_the_reason() -> None:
    status = build_blocked_status({}, 1, "OwnershipConflict", "a Deployment named x exists", T0)
    assert summary(status)["Ready"] == ("False", "OwnershipConflict")
    assert summary(status)["Degraded"] == ("True", "OwnershipConflict")


def test_endpoint_is_the_routers_url_when_a_router_serves_else_the_services() -> None:
    own = build_status({}, observe(deployment()), T0)
    assert own["endpoint"] == own["url"]
    routed = build_status(
        {}, observe(deployment(), endpoint="http://kvpilot-router.ops.svc:80/v1"), T0
    )
    assert routed["endpoint"] == "http://kvpilot-router.ops.svc:80/v1"
    assert routed["url"] == own["url"]  # the Service stays for direct access
