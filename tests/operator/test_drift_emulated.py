"""Drift detection against an emulator that stores Deployments and Services as the API server
does (server_defaults.py): what the server drops or fills in is never drift, a hand edit is.

Each case makes the builders emit a value the server does not store as sent; the operator must
then leave the children alone over resyncs: no DriftRepaired Event, no write, not even a
dry-run (it remembers what the server made of its apply).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator.config import OperatorConfig

from .conftest import (
    DEPLOYMENTS_PATH,
    ISVC_PATH,
    RunningOperator,
    eventually,
    free_ports,
    start_operator,
    stop_operator,
)
from .emulated import DEPLOYMENT, ISVC, SERVICE, api, condition, create_isvc, live, reasons
from .kube_emulator import KubeEmulator
from .server_defaults import stored_deployment

pytestmark = pytest.mark.kmock(cls=KubeEmulator)

BUILTIN = {"uri": "builtin://smollm2-135m-instruct"}
# A model on a claim mounts it readOnly: true, which the server keeps: the cases built on it
# show their own field alone (a non-PVC model brings the readOnly: false along).
ON_CLAIM = {"uri": "pvc://weights/smollm2"}
NAME = "chat"
NUM_RESYNCS = 2


def engine(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


@dataclasses.dataclass(frozen=True)
class Case:
    """A spec whose children hold a value the server stores otherwise than the builders emit
    it; `check` asserts on the stored Deployment that it did (so that the case tests
    something)."""

    id: str
    spec: dict[str, Any]
    check: Callable[[dict[str, Any]], bool]


CASES = [
    # The case: every non-PVC model mounts its cache with readOnly: false.
    Case(
        "false-readOnly",
        {"model": BUILTIN},
        lambda d: "readOnly" not in engine(d)["volumeMounts"][0],
    ),
    # A PVC model's true readOnly is stored as sent (mount and claim).
    Case(
        "true-readOnly",
        {"model": ON_CLAIM},
        lambda d: (
            engine(d)["volumeMounts"][0]["readOnly"] is True
            and pod_spec(d)["volumes"][0]["persistentVolumeClaim"]["readOnly"] is True
        ),
    ),
    # An empty env value (`value,omitempty`)...
    Case(
        "empty-env-value",
        {"model": ON_CLAIM, "engine": {"env": [{"name": "EMPTY", "value": ""}]}},
        lambda d: {"name": "EMPTY"} in engine(d)["env"],
    ),
    # ...also in the hf:// download's init container.
    Case(
        "empty-env-value-init-container",
        {"model": {"uri": "hf://o/m"}, "engine": {"env": [{"name": "EMPTY", "value": ""}]}},
        lambda d: {"name": "EMPTY"} in pod_spec(d)["initContainers"][0]["env"],
    ),
    # A toleration of every taint: key "" (`key,omitempty`).
    Case(
        "empty-toleration-key",
        {"model": ON_CLAIM, "tolerations": [{"key": "", "operator": "Exists"}]},
        lambda d: pod_spec(d)["tolerations"] == [{"operator": "Exists"}],
    ),
    # An empty list inside the user's affinity (`matchFields,omitempty`).
    Case(
        "empty-list-in-affinity",
        {
            "model": ON_CLAIM,
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "pool", "operator": "In", "values": ["cpu"]}
                                ],
                                "matchFields": [],
                            }
                        ]
                    }
                }
            },
        },
        lambda d: (
            "matchFields"
            not in pod_spec(d)["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]["nodeSelectorTerms"][0]
        ),
    ),
    # The default protocol, which the builders spell out (container and Service port).
    Case(
        "default-protocol",
        {"model": ON_CLAIM},
        lambda d: engine(d)["ports"][0]["protocol"] == "TCP",
    ),
    # No pull policy given: the server fills one in (IfNotPresent for a tagged image)...
    Case(
        "default-pull-policy",
        {"model": ON_CLAIM},
        lambda d: engine(d)["imagePullPolicy"] == "IfNotPresent",
    ),
    # ...Always for :latest...
    Case(
        "default-pull-policy-latest",
        {"model": ON_CLAIM, "engine": {"image": "registry.example/kvpilot:latest"}},
        lambda d: engine(d)["imagePullPolicy"] == "Always",
    ),
    # ...and a given one, the default included, is stored as sent.
    Case(
        "given-pull-policy",
        {"model": ON_CLAIM, "engine": {"imagePullPolicy": "IfNotPresent"}},
        lambda d: engine(d)["imagePullPolicy"] == "IfNotPresent",
    ),
    # Quantities come back canonical...
    Case(
        "canonical-quantities",
        {
            "model": ON_CLAIM,
            "resources": {"limits": {"memory": "1024Mi", "cpu": 2}, "requests": {"cpu": "0.5"}},
        },
        lambda d: (
            engine(d)["resources"]
            == {"limits": {"memory": "1Gi", "cpu": "2"}, "requests": {"cpu": "500m"}}
        ),
    ),
    Case(
        "canonical-size-limit",
        {"model": {**BUILTIN, "cache": {"sizeLimit": "2048Mi"}}},
        lambda d: pod_spec(d)["volumes"][0]["emptyDir"] == {"sizeLimit": "2Gi"},
    ),
    # ...and no resources at all is an empty struct, which the server keeps.
    Case("no-resources", {"model": ON_CLAIM}, lambda d: engine(d)["resources"] == {}),
    # Pointer bools keep false (not dropped): still no drift.
    Case(
        "false-pointer-bools",
        {"model": ON_CLAIM},
        lambda d: (
            pod_spec(d)["enableServiceLinks"] is False
            and pod_spec(d)["automountServiceAccountToken"] is False
            and engine(d)["securityContext"]["allowPrivilegeEscalation"] is False
        ),
    ),
]


def child_requests(kmock: KubeEmulator, name: str, *, dry_run: bool) -> list[str]:
    """The operator's writes ("PATCH deployments") to the Deployment and Service of `name`:
    its real ones, or its dry-runs."""
    children = (kmock.resource(DEPLOYMENT), kmock.resource(SERVICE))
    found = []
    for request in list(kmock._requests):
        if request.headers.get("User-Agent", "").startswith("kmock/"):
            continue  # the test's own
        if request.method not in ("POST", "PATCH", "PUT") or request.resource not in children:
            continue
        target = request.name or ((request.data or {}).get("metadata") or {}).get("name")
        if target == name and bool(request.params.get("dryRun")) == dry_run:
            found.append(f"{request.method.value} {request.resource.plural}")
    return found


async def settled(kmock: KubeEmulator, name: str) -> dict[str, Any]:
    """Waits for both children and the first status; returns the Deployment."""
    deployment = await eventually(lambda: live(kmock, DEPLOYMENT, name))
    await eventually(lambda: live(kmock, SERVICE, name))
    await eventually(lambda: condition(kmock, name, "Ready"))
    await eventually(lambda: "Created" in reasons(kmock, name))
    return deployment


async def resyncs(config: OperatorConfig, num: int = NUM_RESYNCS) -> None:
    await asyncio.sleep(num * config.resync_seconds + 0.5)


def test_the_emulator_stores_what_the_builders_emit_as_the_server_does() -> None:
    # The harness itself: a raw false readOnly is dropped, a pointer false kept, defaults added.
    raw = {
        "spec": {
            "template": {
                "spec": {
                    "enableServiceLinks": False,
                    "containers": [
                        {
                            "name": "c",
                            "image": "i:1",
                            "volumeMounts": [{"name": "v", "mountPath": "/m", "readOnly": False}],
                            "args": [],
                        }
                    ],
                }
            }
        }
    }
    pod = stored_deployment(raw)["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False
    assert pod["containers"][0]["volumeMounts"] == [{"name": "v", "mountPath": "/m"}]
    assert "args" not in pod["containers"][0]
    assert pod["containers"][0]["terminationMessagePath"] == "/dev/termination-log"
    assert pod["dnsPolicy"] == "ClusterFirst"


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
async def test_what_the_server_drops_or_defaults_is_not_drift(
    kmock: KubeEmulator, operator: RunningOperator, case: Case
) -> None:
    await create_isvc(kmock, NAME, case.spec)
    deployment = await settled(kmock, NAME)
    assert case.check(deployment), deployment["spec"]["template"]["spec"]
    writes = child_requests(kmock, NAME, dry_run=False)
    # One apply per child (kmock answers server-side apply of a new object with 404, and the
    # create fallback follows).
    assert sorted(writes) == [
        "PATCH deployments",
        "PATCH services",
        "POST deployments",
        "POST services",
    ]

    await resyncs(operator.config)
    assert "DriftRepaired" not in reasons(kmock, NAME)
    assert child_requests(kmock, NAME, dry_run=False) == writes  # no re-apply
    assert child_requests(kmock, NAME, dry_run=True) == []  # the apply's answer is remembered


async def test_a_restarted_operator_asks_the_server_once_and_writes_nothing(
    kmock: KubeEmulator, kubeconfig: Path, operator_config: OperatorConfig
) -> None:
    running = await start_operator(operator_config)
    try:
        await create_isvc(
            kmock, NAME, {"model": BUILTIN, "engine": {"env": [{"name": "E", "value": ""}]}}
        )
        await settled(kmock, NAME)
        writes = child_requests(kmock, NAME, dry_run=False)
        await stop_operator(running)

        # A new process remembers nothing: one dry-run apply per child tells it what the
        # server makes of its manifests, and nothing has drifted.
        metrics_port, liveness_port = free_ports(2)
        running = await start_operator(
            dataclasses.replace(
                operator_config,
                metrics_port=metrics_port,
                liveness_endpoint=f"http://127.0.0.1:{liveness_port}/healthz",
            )
        )
        await eventually(lambda: len(child_requests(kmock, NAME, dry_run=True)) == 2)
        await resyncs(operator_config)
        assert sorted(child_requests(kmock, NAME, dry_run=True)) == [
            "PATCH deployments",
            "PATCH services",
        ]
        assert child_requests(kmock, NAME, dry_run=False) == writes
        assert "DriftRepaired" not in reasons(kmock, NAME)
    finally:
        if running.thread.is_alive():
            await stop_operator(running)


async def hand_edit(
    kmock: KubeEmulator, name: str, edit: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Changes the live Deployment as `kubectl edit` would: the whole object, one field changed."""
    deployment = copy.deepcopy(live(kmock, DEPLOYMENT, name))
    assert deployment is not None
    original = copy.deepcopy(deployment)
    edit(deployment)
    await api(kmock, "PATCH", f"{DEPLOYMENTS_PATH}/{name}", {"spec": deployment["spec"]})
    return original


# Hand edits of fields the operator owns (`kubectl edit deploy`), by what they change.
HAND_EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "image": lambda d: engine(d).update(image="someone-else:2"),
    "command": lambda d: engine(d).update(command=["sleep", "infinity"]),
    "replicas": lambda d: d["spec"].update(replicas=4),  # a fixed-size service
    # A field the server drops as we send it (readOnly: false), set by hand.
    "readOnly": lambda d: engine(d)["volumeMounts"][0].update(readOnly=True),
    "removed-env": lambda d: engine(d)["env"].pop(),
}


@pytest.mark.parametrize("field", HAND_EDITS)
async def test_a_hand_edit_is_repaired_and_reported_once(
    kmock: KubeEmulator, operator: RunningOperator, field: str
) -> None:
    await create_isvc(kmock, NAME, {"model": BUILTIN, "replicas": 1})
    await settled(kmock, NAME)
    await resyncs(operator.config, 1)
    assert "DriftRepaired" not in reasons(kmock, NAME)

    original = await hand_edit(kmock, NAME, HAND_EDITS[field])
    await eventually(lambda: "DriftRepaired" in reasons(kmock, NAME))
    await eventually(lambda: live(kmock, DEPLOYMENT, NAME)["spec"] == original["spec"])  # type: ignore[index]
    await resyncs(operator.config)
    assert reasons(kmock, NAME).count("DriftRepaired") == 1
    assert live(kmock, DEPLOYMENT, NAME)["spec"] == original["spec"]  # type: ignore[index]
    assert "Scaled" not in reasons(kmock, NAME)  # a hand scale is drift, not the spec's scale


async def test_autoscaled_replicas_are_never_drift(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    spec = {"model": BUILTIN, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}
    await create_isvc(kmock, NAME, spec)
    await settled(kmock, NAME)
    writes = child_requests(kmock, NAME, dry_run=False)
    # Another count within the bounds (the autoscaler's, or `kubectl scale`) is kept as it is.
    await api(kmock, "PATCH", f"{DEPLOYMENTS_PATH}/{NAME}", {"spec": {"replicas": 3}})
    await eventually(lambda: live(kmock, ISVC, NAME)["status"]["desiredReplicas"] == 3)  # type: ignore[index]
    await resyncs(operator.config)
    assert live(kmock, DEPLOYMENT, NAME)["spec"]["replicas"] == 3  # type: ignore[index]
    assert "DriftRepaired" not in reasons(kmock, NAME)
    assert child_requests(kmock, NAME, dry_run=False) == writes


async def test_a_spec_scale_is_a_scale_not_drift(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    await create_isvc(kmock, NAME, {"model": BUILTIN, "replicas": 1})
    await settled(kmock, NAME)
    await api(kmock, "PATCH", f"{ISVC_PATH}/{NAME}", {"spec": {"replicas": 2}})
    await eventually(lambda: live(kmock, DEPLOYMENT, NAME)["spec"]["replicas"] == 2)  # type: ignore[index]
    await eventually(lambda: "Scaled" in reasons(kmock, NAME))
    await resyncs(operator.config)
    assert "DriftRepaired" not in reasons(kmock, NAME)
    assert reasons(kmock, NAME).count("Scaled") == 1
