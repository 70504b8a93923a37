"""The real operator (`kvpilot operator`'s code path: kopf + our handlers + the kubernetes client)
against kmock's Kubernetes emulator over HTTP. The test plays the rest of the cluster: it
writes the Deployment controller's status and the kubelet's pods into the emulator.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvpilot.operator.autoscaling import AutoscalingPolicy
from kvpilot.operator.kube import KubeApi, connect
from kvpilot.operator.reconcile import Reconciler

from .chart import operator_rules, rbac_allows
from .conftest import (
    DEPLOYMENTS_PATH,
    ENGINE_IMAGE,
    ISVC_PATH,
    NAMESPACE,
    PODS_PATH,
    RunningOperator,
    eventually,
)
from .emulated import (
    DEPLOYMENT,
    ISVC,
    SERVICE,
    api,
    condition,
    create_isvc,
    engine_args,
    events,
    live,
    rbac_call,
    reasons,
    status_writes,
)
from .kube_emulator import KubeEmulator

pytestmark = pytest.mark.kmock(cls=KubeEmulator)


async def test_lifecycle_create_status_update_drift_delete(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    created = await create_isvc(
        kmock,
        "chat",
        {
            "model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"},
            "engine": {"maxNumSeqs": 16},
            "replicas": 2,
            "gpus": 1,
        },
    )
    uid = created["metadata"]["uid"]

    # Children with the expected fields and owner references.
    deployment = await eventually(lambda: live(kmock, DEPLOYMENT, "chat"))
    service = await eventually(lambda: live(kmock, SERVICE, "chat"))
    owner = {"kind": "InferenceService", "name": "chat", "uid": uid, "controller": True}
    for child in (deployment, service):
        assert owner.items() <= child["metadata"]["ownerReferences"][0].items()
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == ENGINE_IMAGE
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["initContainers"][0]["name"] == "model-fetch"
    args = engine_args(deployment)
    assert args[args.index("--max-num-seqs") + 1] == "16"
    assert args[args.index("--model") + 1] == "/models/hf/Qwen/Qwen2.5-0.5B-Instruct/main"
    assert service["spec"]["ports"][0]["port"] == 8000
    assert service["spec"]["ports"][0]["name"] == "http"

    # Status: observedGeneration, the three conditions, where to reach the model.
    status = await eventually(lambda: (live(kmock, ISVC, "chat") or {}).get("status"))
    assert status["observedGeneration"] == 1
    assert {c["type"] for c in status["conditions"]} == {
        *("Ready", "Progressing", "Degraded"),
        *("Reconciling", "Stalled"),  # kstatus
    }
    assert condition(kmock, "chat", "Ready")[:2] == ("False", "WaitingForReplicas")  # type: ignore[index]
    assert status["url"] == f"http://chat.{NAMESPACE}.svc:8000/v1"
    assert status["model"] == "chat"
    assert status["desiredReplicas"] == 2
    await eventually(lambda: {"Created", "WaitingForReplicas"} <= set(reasons(kmock, "chat")))
    assert live(kmock, ISVC, "chat")["metadata"]["finalizers"] == ["kvpilot.dev/finalizer"]  # type: ignore[index]

    # The liveness endpoint answers.
    async with (
        aiohttp.ClientSession() as session,
        session.get(operator.config.liveness_endpoint or "") as response,
    ):
        assert response.status == 200

    # The Deployment controller reports the pods ready: Ready flips without waiting for a timer.
    generation = deployment["metadata"]["generation"]
    ready = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "availableReplicas": 2}
    await api(
        kmock,
        "PATCH",
        f"{DEPLOYMENTS_PATH}/chat/status",
        {"status": {**ready, "observedGeneration": generation}},
    )
    await eventually(lambda: condition(kmock, "chat", "Ready")[:2] == ("True", "Serving"))  # type: ignore[index]
    assert condition(kmock, "chat", "Progressing")[:2] == ("False", "RolloutComplete")  # type: ignore[index]

    # A spec change patches the Deployment and is observed.
    await api(kmock, "PATCH", f"{ISVC_PATH}/chat", {"spec": {"engine": {"maxNumSeqs": 32}}})
    await eventually(lambda: "32" in engine_args(live(kmock, DEPLOYMENT, "chat") or deployment))
    await eventually(lambda: live(kmock, ISVC, "chat")["status"]["observedGeneration"] == 2)  # type: ignore[index]
    await eventually(lambda: "Updated" in reasons(kmock, "chat"))

    # Scaling through the spec (what HPA or `kubectl scale kis` do).
    await api(kmock, "PATCH", f"{ISVC_PATH}/chat", {"spec": {"replicas": 3}})
    await eventually(lambda: live(kmock, DEPLOYMENT, "chat")["spec"]["replicas"] == 3)  # type: ignore[index]
    await eventually(lambda: "Scaled" in reasons(kmock, "chat"))

    # Someone edits the Deployment by hand: the drift is repaired.
    edit = {"spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "hack:1"}]}}}}
    await api(kmock, "PATCH", f"{DEPLOYMENTS_PATH}/chat", edit)
    await eventually(
        lambda: (
            live(kmock, DEPLOYMENT, "chat")["spec"]["template"]["spec"]["containers"][0][  # type: ignore[index]
                "image"
            ]
            == ENGINE_IMAGE
        )
    )
    await eventually(lambda: "DriftRepaired" in reasons(kmock, "chat"))

    # Someone deletes the Deployment: it comes back.
    old_uid = live(kmock, DEPLOYMENT, "chat")["metadata"]["uid"]  # type: ignore[index]
    await api(kmock, "DELETE", f"{DEPLOYMENTS_PATH}/chat")
    recreated = await eventually(
        lambda: (d := live(kmock, DEPLOYMENT, "chat")) and d["metadata"]["uid"] != old_uid and d
    )
    assert recreated["spec"]["replicas"] == 3

    # Every API call the operator made is allowed by the chart's ClusterRole.
    rules = operator_rules()
    denied = sorted(
        {
            call
            for call in map(rbac_call, kmock._requests)
            if call is not None and not rbac_allows(rules, *call)
        }
    )
    assert denied == []

    # Deleting the InferenceService: kopf releases its finalizer and the object goes.
    await api(kmock, "DELETE", f"{ISVC_PATH}/chat")
    await eventually(lambda: live(kmock, ISVC, "chat") is None)


async def test_invalid_spec_reports_once_and_recovers(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    # The CRD's schema cannot see this (extraArgs is a free list): only the model can.
    bad = {
        "model": {"uri": "builtin://smollm2-135m-instruct"},
        "engine": {"extraArgs": ["--port", "9000"]},
    }
    await create_isvc(kmock, "broken", bad)
    await eventually(lambda: (condition(kmock, "broken", "Ready") or ("",))[0] == "False")
    _, reason, message = condition(kmock, "broken", "Ready")  # type: ignore[misc]
    assert reason == "InvalidSpec"
    assert "spec.engine.extraArgs: extraArgs may not set --port" in message
    await eventually(lambda: "InvalidSpec" in reasons(kmock, "broken"))
    warning = next(e for e in events(kmock, "broken") if e["reason"] == "InvalidSpec")
    assert warning["type"] == "Warning" and "--port" in warning["message"]

    # One bad object does not stop the operator: another one is served meanwhile.
    await create_isvc(kmock, "fine", {"model": {"uri": "builtin://smollm2-135m-instruct"}})
    await eventually(lambda: live(kmock, DEPLOYMENT, "fine"))

    # No retry storm: several resync periods later, still one Warning and no Deployment.
    writes_before = status_writes(kmock, "broken")
    await asyncio.sleep(3 * operator.config.resync_seconds)
    assert reasons(kmock, "broken").count("InvalidSpec") == 1
    assert status_writes(kmock, "broken") == writes_before
    assert live(kmock, DEPLOYMENT, "broken") is None
    assert operator.thread.is_alive()

    # Fixing the spec recovers.
    await api(kmock, "PATCH", f"{ISVC_PATH}/broken", {"spec": {"engine": {"extraArgs": None}}})
    await eventually(lambda: live(kmock, DEPLOYMENT, "broken"))
    await eventually(
        lambda: condition(kmock, "broken", "Ready")[:2] == ("False", "WaitingForReplicas")  # type: ignore[index]
    )
    assert condition(kmock, "broken", "Degraded")[:2] == ("False", "AsExpected")  # type: ignore[index]


async def test_a_foreign_object_under_our_name_is_not_taken_over(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    foreign = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "taken", "namespace": NAMESPACE},
        "spec": {
            "replicas": 1,
            "template": {"spec": {"containers": [{"name": "x", "image": "y"}]}},
        },
    }
    await api(kmock, "POST", DEPLOYMENTS_PATH, foreign)
    await create_isvc(kmock, "taken", {"model": {"uri": "builtin://smollm2-135m-instruct"}})
    await eventually(
        lambda: (condition(kmock, "taken", "Ready") or ("", ""))[1] == "OwnershipConflict"
    )
    assert (
        live(kmock, DEPLOYMENT, "taken")["spec"]["template"]["spec"]["containers"][0]["image"]
        == "y"
    )  # type: ignore[index]
    assert "ownerReferences" not in live(kmock, DEPLOYMENT, "taken")["metadata"]  # type: ignore[index]


async def test_pod_problems_become_degraded_with_the_pods_message(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    await create_isvc(kmock, "chat", {"model": {"uri": "builtin://smollm2-135m-instruct"}})
    await eventually(lambda: condition(kmock, "chat", "Degraded"))
    labels = live(kmock, DEPLOYMENT, "chat")["spec"]["template"]["metadata"]["labels"]  # type: ignore[index]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "chat-7f9c-x1", "labels": labels},
    }
    await api(kmock, "POST", PODS_PATH, pod)
    crash = {
        "phase": "Running",
        "containerStatuses": [
            {
                "name": "engine",
                "restartCount": 5,
                "ready": False,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 2m40s"}},
                "lastState": {
                    "terminated": {
                        "exitCode": 1,
                        "reason": "Error",
                        "message": "RuntimeError: CUDA error: no kernel image is available",
                    }
                },
            }
        ],
    }
    await api(kmock, "PATCH", f"{PODS_PATH}/chat-7f9c-x1/status", {"status": crash})

    # Nothing the operator watches changed: the resync timer finds it.
    await eventually(
        lambda: condition(kmock, "chat", "Degraded")[:2] == ("True", "CrashLoopBackOff")
    )  # type: ignore[index]
    _, _, message = condition(kmock, "chat", "Degraded")  # type: ignore[misc]
    assert "chat-7f9c-x1" in message and "no kernel image is available" in message
    assert condition(kmock, "chat", "Ready")[1] == "CrashLoopBackOff"  # type: ignore[index]
    await eventually(lambda: "CrashLoopBackOff" in reasons(kmock, "chat"))
    warning = next(e for e in events(kmock, "chat") if e["reason"] == "CrashLoopBackOff")
    assert warning["type"] == "Warning"

    # Pods that do not belong to it are not its problem.
    stranger = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "other", "labels": {"a": "b"}},
    }
    await api(kmock, "POST", PODS_PATH, stranger)
    await api(kmock, "PATCH", f"{PODS_PATH}/other/status", {"status": crash})

    # The pod recovers.
    healthy = {
        "phase": "Running",
        "containerStatuses": [
            {"name": "engine", "restartCount": 5, "ready": True, "state": {"running": {}}}
        ],
    }
    await api(kmock, "PATCH", f"{PODS_PATH}/chat-7f9c-x1/status", {"status": healthy})
    await eventually(lambda: condition(kmock, "chat", "Degraded")[:2] == ("False", "AsExpected"))  # type: ignore[index]


async def test_autoscaled_replicas_are_left_to_the_autoscaler(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    spec = {
        "model": {"uri": "builtin://smollm2-135m-instruct"},
        "autoscaling": {"minReplicas": 2, "maxReplicas": 4},
    }
    await create_isvc(kmock, "auto", spec)
    await create_isvc(kmock, "fixed", {"model": spec["model"], "replicas": 1})
    deployment = await eventually(lambda: live(kmock, DEPLOYMENT, "auto"))
    assert deployment["spec"]["replicas"] == 2  # starts at minReplicas
    await eventually(lambda: live(kmock, DEPLOYMENT, "fixed"))

    # The autoscaler's hook scales the Deployment (clamped to the bounds) and writes its status.
    autoscaler = Reconciler(KubeApi(connect()), operator.config, lambda *_: None)
    generation = live(kmock, ISVC, "auto")["metadata"]["generation"]  # type: ignore[index]
    seen = (generation, AutoscalingPolicy(min_replicas=2, max_replicas=4))
    applied = await asyncio.to_thread(
        autoscaler.apply_scale,
        NAMESPACE,
        "auto",
        3,
        {"autoscaling": {"mode": "stable"}},
        seen=seen,
    )
    assert applied == 3
    assert live(kmock, DEPLOYMENT, "auto")["spec"]["replicas"] == 3  # type: ignore[index]
    scale = autoscaler.apply_scale
    assert await asyncio.to_thread(scale, NAMESPACE, "auto", 99, seen=seen) == 4
    assert await asyncio.to_thread(scale, NAMESPACE, "auto", 3, seen=seen) == 3
    # A decision made on an older spec is refused: the next tick decides on the new one.
    stale = (generation - 1, seen[1])
    assert await asyncio.to_thread(scale, NAMESPACE, "auto", 4, seen=stale) is None
    # A fixed-size service is not the autoscaler's to scale.
    assert await asyncio.to_thread(scale, NAMESPACE, "fixed", 3, seen=seen) is None
    assert live(kmock, DEPLOYMENT, "fixed")["spec"]["replicas"] == 1  # type: ignore[index]

    # Reconcile (timer, child events) leaves the count alone, and keeps the autoscaler's status...
    await eventually(lambda: live(kmock, ISVC, "auto")["status"]["desiredReplicas"] == 3)  # type: ignore[index]
    await asyncio.sleep(2 * operator.config.resync_seconds)
    assert live(kmock, DEPLOYMENT, "auto")["spec"]["replicas"] == 3  # type: ignore[index]
    # (the operator's own autoscaler may have ticked meanwhile: it writes the same mode)
    assert live(kmock, ISVC, "auto")["status"]["autoscaling"]["mode"] == "stable"  # type: ignore[index]

    # ...also through a spec change that rolls the pods...
    await api(kmock, "PATCH", f"{ISVC_PATH}/auto", {"spec": {"engine": {"maxNumSeqs": 8}}})
    await eventually(lambda: "8" in engine_args(live(kmock, DEPLOYMENT, "auto") or deployment))
    assert live(kmock, DEPLOYMENT, "auto")["spec"]["replicas"] == 3  # type: ignore[index]

    # ...but narrower bounds clamp it.
    await api(kmock, "PATCH", f"{ISVC_PATH}/auto", {"spec": {"autoscaling": {"maxReplicas": 2}}})
    await eventually(lambda: live(kmock, DEPLOYMENT, "auto")["spec"]["replicas"] == 2)  # type: ignore[index]

    # Turning autoscaling off hands the count back to spec.replicas and drops the stale state.
    await api(kmock, "PATCH", f"{ISVC_PATH}/auto", {"spec": {"autoscaling": None, "replicas": 1}})
    await eventually(lambda: live(kmock, DEPLOYMENT, "auto")["spec"]["replicas"] == 1)  # type: ignore[index]
    await eventually(lambda: "autoscaling" not in live(kmock, ISVC, "auto")["status"])  # type: ignore[index]


async def test_api_errors_are_retried(kmock: KubeEmulator, operator: RunningOperator) -> None:
    # The API server fails the operator's first reads of this object (kopf's watch still works).
    flaky = f"get {ISVC_PATH}/flaky"
    kmock[flaky][:3] << 503
    await create_isvc(kmock, "flaky", {"model": {"uri": "builtin://smollm2-135m-instruct"}})
    await eventually(lambda: live(kmock, DEPLOYMENT, "flaky"))
    await eventually(lambda: condition(kmock, "flaky", "Ready"))
    failed = [
        r for r in kmock._requests if r.method == "GET" and r.url.path == f"{ISVC_PATH}/flaky"
    ]
    assert len(failed) > 3  # three 503s, then the retries that went through
    assert operator.thread.is_alive()


PDB = "policy/v1/poddisruptionbudgets"
NETWORK_POLICY = "networking.k8s.io/v1/networkpolicies"


async def test_disruption_budget_and_network_policy_follow_the_spec(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    model = {"uri": "builtin://smollm2-135m-instruct"}
    await create_isvc(kmock, "pdb", {"model": model, "replicas": 2})
    budget = await eventually(lambda: live(kmock, PDB, "pdb"))
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    assert live(kmock, NETWORK_POLICY, "pdb") is None  # not asked for

    # Down to one replica: the budget goes (it would only ever block drains).
    await api(kmock, "PATCH", f"{ISVC_PATH}/pdb", {"spec": {"replicas": 1}})
    await eventually(lambda: live(kmock, PDB, "pdb") is None)
    await eventually(lambda: "Deleted" in reasons(kmock, "pdb"))  # kopf posts Events async
    # Autoscaled up to 3 (at 1 replica now): a budget again; and a NetworkPolicy on request.
    patch = {
        "replicas": None,
        "autoscaling": {"maxReplicas": 3},
        "networkPolicy": {"allowNamespaces": ["web"]},
    }
    await api(kmock, "PATCH", f"{ISVC_PATH}/pdb", {"spec": patch})
    await eventually(lambda: live(kmock, PDB, "pdb"))
    policy = await eventually(lambda: live(kmock, NETWORK_POLICY, "pdb"))
    assert policy["spec"]["ingress"][0]["from"][1]["namespaceSelector"]["matchExpressions"][0][
        "values"
    ] == ["web"]
    await api(kmock, "PATCH", f"{ISVC_PATH}/pdb", {"spec": {"networkPolicy": None}})
    await eventually(lambda: live(kmock, NETWORK_POLICY, "pdb") is None)
    assert live(kmock, PDB, "pdb") is not None

    # Every call it made for them is in the chart's ClusterRole.
    rules = operator_rules()
    calls = {call for call in map(rbac_call, kmock._requests) if call is not None}
    assert ("policy", "poddisruptionbudgets", "delete") in calls
    assert [call for call in calls if not rbac_allows(rules, *call)] == []
