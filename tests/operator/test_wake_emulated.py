"""Wake from zero with the real operator (kopf + our handlers) against kmock: an InferenceService
with minReplicas 0 starts at zero replicas; a router's wake annotation scales it to one at once
(a watch event, not an autoscaler tick: the tick here is a minute apart), with an Event; a wake
that finds replicas already running changes nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvpilot.contract.kube import ANNOTATION_WAKE
from kvpilot.operator.config import OperatorConfig

from .conftest import ISVC_PATH, eventually
from .emulated import DEPLOYMENT, api, create_isvc, live, reasons
from .kube_emulator import KubeEmulator

pytestmark = pytest.mark.kmock(cls=KubeEmulator)

NAME = "sleepy"
SPEC: dict[str, Any] = {
    "model": {"uri": "builtin://smollm2-135m-instruct"},
    "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 600},
}


@pytest.fixture()
def operator_config(operator_config: OperatorConfig) -> OperatorConfig:
    return dataclasses.replace(operator_config, autoscale_interval_seconds=60.0)


def replicas(kmock: KubeEmulator) -> int | None:
    deployment = live(kmock, DEPLOYMENT, NAME)
    return None if deployment is None else deployment["spec"].get("replicas")


async def wake(kmock: KubeEmulator, when: str) -> None:
    body = {"metadata": {"annotations": {ANNOTATION_WAKE: f"{when} router-0"}}}
    await api(kmock, "PATCH", f"{ISVC_PATH}/{NAME}", body)


async def test_a_wake_annotation_scales_zero_to_one_at_once(
    kmock: KubeEmulator, operator: object
) -> None:
    await create_isvc(kmock, NAME, SPEC)
    await eventually(lambda: replicas(kmock) == 0)
    await wake(kmock, "2026-01-01T00:00:00.000+00:00")
    await eventually(lambda: replicas(kmock) == 1, timeout=10)
    await eventually(lambda: "WakeFromZero" in reasons(kmock, NAME))

    # Already up (say the autoscaler made it 2): a later wake leaves it alone.
    await api(
        kmock, "PATCH", f"/apis/apps/v1/namespaces/serving/deployments/{NAME}",
        {"spec": {"replicas": 2}},
    )  # fmt: skip
    await wake(kmock, "2026-01-01T00:00:05.000+00:00")
    await eventually(lambda: reasons(kmock, NAME).count("WakeFromZero") == 1)
    assert replicas(kmock) == 2
