"""An operator killed mid-reconcile, then a fresh one against the same cluster (kmock's emulator).

The first operator runs as `kvpilot operator` in a process of its own and is killed with SIGKILL
(as a crash or an evicted pod would end it) while one of its writes is held unanswered by the
emulator: either the status patch after the Deployment was applied (the children exist, the status
says nothing of them), or the Deployment's apply for a spec change (the Deployment is stale). The
fresh operator must converge from what it finds: one Deployment of the current spec, the status of
the current generation with the right conditions, no duplicate work and no storm of Events.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator.builders import Owner, build_deployment
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.drift import config_hash_of, with_config_hash
from kvpilot.operator.spec import parse_spec

from .conftest import (
    DEPLOYMENTS_PATH,
    ENGINE_IMAGE,
    ISVC_PATH,
    NAMESPACE,
    eventually,
    free_port,
    start_operator,
    stop_operator,
)
from .emulated import DEPLOYMENT, ISVC, SERVICE, api, condition, create_isvc, engine_args, live
from .kube_emulator import KubeEmulator

pytestmark = pytest.mark.kmock(cls=KubeEmulator)

NAME = "restart"
BUILTIN = {"model": {"uri": "builtin://smollm2-135m-instruct"}}


class CrashingOperator:
    """`kvpilot operator` in a process of its own, to be killed as a crash would end it."""

    def __init__(self, log: Path) -> None:
        self._log = log.open("wb")
        command = [
            sys.executable, "-m", "kvpilot.cli", "operator", f"--namespace={NAMESPACE}",
            f"--engine-image={ENGINE_IMAGE}", "--resync-seconds=1", "--metrics-port=0",
            f"--liveness-endpoint=http://127.0.0.1:{free_port()}/healthz",
        ]  # fmt: skip
        # $KUBECONFIG (the kubeconfig fixture's) points it at the emulator.
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        self._log.close()


@pytest.fixture()
async def crashing(kubeconfig: Path, tmp_path: Path) -> AsyncIterator[CrashingOperator]:
    first = CrashingOperator(tmp_path / "first-operator.log")
    yield first
    first.kill()


def writes(kmock: KubeEmulator, path: str) -> int:
    return sum(
        1
        for request in kmock._requests
        if request.method in ("PATCH", "POST")
        and request.url.path == path
        and not request.params.get("dryRun")
    )


def objects(kmock: KubeEmulator, resource: str) -> list[dict[str, Any]]:
    key = kmock.resource(resource)
    return [
        obj.raw for (r, _, _), obj in list(kmock.objects.items()) if r == key and not obj.deleted
    ]


def operator_events(kmock: KubeEmulator) -> list[tuple[str, str, str]]:
    """(type, reason, message) of every Event about the InferenceService."""
    return [
        (event["type"], event["reason"], event["message"])
        for event in objects(kmock, "v1/events")
        if event.get("involvedObject", {}).get("name") == NAME
    ]


def is_converged(kmock: KubeEmulator) -> bool:
    isvc = live(kmock, ISVC, NAME) or {}
    deployment = live(kmock, DEPLOYMENT, NAME)
    if deployment is None or not isvc:
        return False
    metadata = isvc["metadata"]
    owner = Owner(name=NAME, namespace=NAMESPACE, uid=metadata["uid"])
    wanted = with_config_hash(
        build_deployment(owner, parse_spec(isvc["spec"]), default_image=ENGINE_IMAGE, replicas=1)
    )
    status = isvc.get("status") or {}
    return (
        config_hash_of(deployment) == config_hash_of(wanted)  # of the current spec, not stale
        and status.get("observedGeneration") == metadata["generation"]
        and condition(kmock, NAME, "Ready") is not None
    )


def is_status_write(request: Any) -> bool:
    return request.method == "PATCH" and request.url.path == f"{ISVC_PATH}/{NAME}/status"


def is_deployment_apply(request: Any) -> bool:
    return (
        request.method == "PATCH"
        and request.url.path == f"{DEPLOYMENTS_PATH}/{NAME}"
        and not request.params.get("dryRun")
    )


async def create_and_hold_status(kmock: KubeEmulator, hold: asyncio.Event) -> None:
    """The first operator creates the children; its status patch is held."""
    fault = kmock.inject_fault(is_status_write, 504, count=1, hold=hold)
    await create_isvc(kmock, NAME, BUILTIN)
    await eventually(lambda: fault.hits, timeout=60)  # it starts up, then reconciles
    assert live(kmock, DEPLOYMENT, NAME) is not None and live(kmock, SERVICE, NAME) is not None
    # kopf posts Events from a queue of its own: let the two Created ones go out before the crash.
    await eventually(lambda: len(operator_events(kmock)) == 2, timeout=10)
    assert (live(kmock, ISVC, NAME) or {}).get("status") is None


async def change_spec_and_hold_apply(kmock: KubeEmulator, hold: asyncio.Event) -> None:
    """The first operator converges; then a spec change's Deployment apply is held."""
    await create_isvc(kmock, NAME, BUILTIN)
    await eventually(lambda: is_converged(kmock), timeout=60)
    fault = kmock.inject_fault(is_deployment_apply, 504, count=1, hold=hold)
    await api(kmock, "PATCH", f"{ISVC_PATH}/{NAME}", {"spec": {"engine": {"maxNumSeqs": 4}}})
    await eventually(lambda: fault.hits, timeout=30)
    assert "4" not in engine_args(live(kmock, DEPLOYMENT, NAME) or {})  # stale: not applied


@pytest.mark.parametrize(
    "crash_point",
    [create_and_hold_status, change_spec_and_hold_apply],
    ids=["between-apply-and-status", "during-deployment-apply"],
)
async def test_a_fresh_operator_converges_after_a_crash_mid_reconcile(
    kmock: KubeEmulator,
    crashing: CrashingOperator,
    operator_config: OperatorConfig,
    crash_point: Callable[[KubeEmulator, asyncio.Event], Any],
) -> None:
    hold = asyncio.Event()
    await crash_point(kmock, hold)
    crashing.kill()  # mid-reconcile: its write is still unanswered
    assert crashing.process.returncode == -signal.SIGKILL
    hold.set()  # the held request is answered (504, not applied) to a client long gone
    events_before = operator_events(kmock)
    deployment_writes = writes(kmock, f"{DEPLOYMENTS_PATH}/{NAME}")

    fresh = await start_operator(operator_config)
    try:
        await eventually(lambda: is_converged(kmock), timeout=60)
        # One Deployment and one Service, both controlled by the InferenceService.
        uid = live(kmock, ISVC, NAME)["metadata"]["uid"]  # type: ignore[index]
        for resource in (DEPLOYMENT, SERVICE):
            (child,) = objects(kmock, resource)
            (reference,) = child["metadata"]["ownerReferences"]
            assert (reference["uid"], reference["controller"]) == (uid, True)
        assert condition(kmock, NAME, "Ready")[:2] == ("False", "WaitingForReplicas")  # type: ignore[index]
        assert condition(kmock, NAME, "Degraded")[:2] == ("False", "AsExpected")  # type: ignore[index]
        isvc = live(kmock, ISVC, NAME)
        assert isvc is not None
        assert isvc["status"]["url"] == f"http://{NAME}.{NAMESPACE}.svc:8000/v1"
        assert len(isvc["metadata"]["finalizers"]) == 1
        # Quiet once converged: no further writes of the Deployment, no further Events.
        await asyncio.sleep(3 * operator_config.resync_seconds)
        settled_writes = writes(kmock, f"{DEPLOYMENTS_PATH}/{NAME}")
        settled_events = operator_events(kmock)
        await asyncio.sleep(3 * operator_config.resync_seconds)
        assert writes(kmock, f"{DEPLOYMENTS_PATH}/{NAME}") == settled_writes
        assert operator_events(kmock) == settled_events
    finally:
        await stop_operator(fresh)

    # What the fresh operator did: at most the one write the crash left undone, and one Event
    # per change it made or found, none a warning.
    assert settled_writes - deployment_writes <= 1
    new_events = settled_events[len(events_before) :]
    assert not [event for event in new_events if event[0] == "Warning"], new_events
    reasons = [reason for _, reason, _ in new_events]
    if crash_point is create_and_hold_status:
        assert settled_writes == deployment_writes  # the Deployment was there already
        assert "Created" not in reasons and "Updated" not in reasons
    else:
        assert reasons.count("Updated") == 1  # the apply the crash lost, made once
    assert len(new_events) <= 4, new_events
