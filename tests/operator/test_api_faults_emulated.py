"""The real operator (kopf) against kmock with the API server misbehaving: conflicts (409), server
errors (500) and a hung server (no answer within the operator's API timeout) on the Deployment's
apply are retried with backoff until the object converges, without a storm of requests, and all
is quiet afterwards. (The operator's reads failing with 503 are in test_operator_emulated.py.)

Faults are injected through the emulator (KubeEmulator.inject_fault): a failed write is not
applied, so every injected fault must be hit by a write of its own before the spec lands.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from kvpilot.operator.config import OperatorConfig

from .conftest import (
    DEPLOYMENTS_PATH,
    ISVC_PATH,
    RunningOperator,
    eventually,
)
from .emulated import DEPLOYMENT, ISVC, api, condition, create_isvc, engine_args, events, live
from .kube_emulator import Fault, KubeEmulator

pytestmark = pytest.mark.kmock(cls=KubeEmulator)

BUILTIN = {"model": {"uri": "builtin://smollm2-135m-instruct"}}
# The operator's API timeout here, and how long a hung write goes unanswered (well past it).
API_TIMEOUT_SECONDS = 1.0
HANG_SECONDS = 6.0


@pytest.fixture()
def operator_config(operator_config: OperatorConfig) -> OperatorConfig:
    return dataclasses.replace(operator_config, api_timeout_seconds=API_TIMEOUT_SECONDS)


def is_write(name: str) -> Any:
    """The operator's writes of Deployment `name`: server-side apply PATCHes, dry runs aside."""
    path = f"{DEPLOYMENTS_PATH}/{name}"
    return lambda r: r.method == "PATCH" and r.url.path == path and not r.params.get("dryRun")


def applies(kmock: KubeEmulator, name: str) -> int:
    return sum(1 for request in kmock._requests if is_write(name)(request))


def is_converged(kmock: KubeEmulator, name: str) -> bool:
    """The new spec is in the Deployment and the status is of the new generation (a reconcile
    whose write failed stops before the status)."""
    isvc = live(kmock, ISVC, name) or {}
    deployment = live(kmock, DEPLOYMENT, name)
    return (
        deployment is not None
        and "4" in engine_args(deployment)
        and (isvc.get("status") or {}).get("observedGeneration") == isvc["metadata"]["generation"]
    )


async def ready(kmock: KubeEmulator, *names: str) -> None:
    for name in names:
        await create_isvc(kmock, name, BUILTIN)
    for name in names:
        await eventually(lambda n=name: live(kmock, DEPLOYMENT, n), timeout=60)
        await eventually(lambda n=name: condition(kmock, n, "Ready"), timeout=30)


async def change_and_converge(
    kmock: KubeEmulator, operator: RunningOperator, faults: dict[str, Fault]
) -> None:
    """Changes each spec; each Deployment's next writes hit its fault. Checks that every fault
    was hit, the spec landed, the number of writes is bounded, and all is quiet afterwards."""
    before = {name: applies(kmock, name) for name in faults}
    for name in faults:
        await api(kmock, "PATCH", f"{ISVC_PATH}/{name}", {"spec": {"engine": {"maxNumSeqs": 4}}})
    for name in faults:
        await eventually(lambda n=name: is_converged(kmock, n), timeout=90)
    for name, fault in faults.items():
        assert len(fault.hits) == fault.count, name  # every injected fault was hit
        count = applies(kmock, name) - before[name]
        # A storm would be dozens of writes a second; here: the faults, one success, and at most
        # a retry per resync period in flight at that moment.
        assert count <= fault.count + 3, (name, count)
    # Once converged, quiet: resyncs make no further writes.
    counts = {name: applies(kmock, name) for name in faults}
    await asyncio.sleep(3 * operator.config.resync_seconds)
    assert {name: applies(kmock, name) for name in faults} == counts
    assert operator.thread.is_alive()


async def test_409_and_500_are_retried_with_backoff_not_a_storm(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    await ready(kmock, "conflict", "error")
    faults = {
        "conflict": kmock.inject_fault(is_write("conflict"), 409, count=2),
        "error": kmock.inject_fault(is_write("error"), 500, count=2),
    }
    await change_and_converge(kmock, operator, faults)


async def test_a_hung_api_server_times_out_and_is_retried_not_a_storm(
    kmock: KubeEmulator, operator: RunningOperator, caplog: pytest.LogCaptureFixture
) -> None:
    await ready(kmock, "hung")
    fault = kmock.inject_fault(is_write("hung"), 504, count=2, delay=HANG_SECONDS)
    await change_and_converge(kmock, operator, {"hung": fault})
    # The operator gave up on the first hung write after its own timeout: the second write came
    # while the first was still unanswered, which the per-object lock allows only once the
    # first call has returned (a client without a timeout would still be waiting).
    assert fault.hits[1] - fault.hits[0] < HANG_SECONDS
    assert any("API call timed out" in record.getMessage() for record in caplog.records)
    # No pod runs in the emulator: waiting for replicas, nothing degraded.
    assert condition(kmock, "hung", "Ready")[:2] == ("False", "WaitingForReplicas")  # type: ignore[index]
    assert condition(kmock, "hung", "Degraded")[:2] == ("False", "AsExpected")  # type: ignore[index]
    assert len(events(kmock, "hung")) < 20  # no storm of Events either
    # Let the hung answers go out before the emulator stops.
    await asyncio.sleep(max(0.0, fault.hits[-1] + HANG_SECONDS - time.monotonic()))
