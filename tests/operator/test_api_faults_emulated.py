"""The real operator (kopf) against kmock with the API server misbehaving: conflicts (409) and
server errors (500) on the Deployment's apply are retried with backoff until the object
converges, without a storm of requests, and all is quiet afterwards. (The operator's reads failing
with 503 are in test_operator_emulated.py.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from .conftest import (
    DEPLOYMENTS_PATH,
    ISVC_PATH,
    RunningOperator,
    eventually,
)
from .emulated import DEPLOYMENT, ISVC, api, condition, create_isvc, engine_args, live
from .kube_emulator import KubeEmulator

pytestmark = pytest.mark.kmock(cls=KubeEmulator)

BUILTIN = {"model": {"uri": "builtin://smollm2-135m-instruct"}}


def applies(kmock: KubeEmulator, name: str) -> list[Any]:
    """The operator's writes of that Deployment (server-side apply PATCHes, dry runs aside)."""
    path = f"{DEPLOYMENTS_PATH}/{name}"
    return [
        r
        for r in kmock._requests
        if r.method == "PATCH" and r.url.path == path and "dryRun" not in str(r.url.query)
    ]


def next_writes(name: str, times: list[float], count: int | list[int]) -> Any:
    """A kmock filter: the next `count` writes of Deployment `name` (dry runs aside), each noted
    in `times` (kmock's slices count the whole history, so a counter does it)."""
    path = f"{DEPLOYMENTS_PATH}/{name}"
    remaining = count if isinstance(count, list) else [count]  # the caller may reset it
    seen: set[int] = set()

    def pick(request: Any) -> bool:
        if request.method != "PATCH" or request.url.path != path or request.params.get("dryRun"):
            return False
        if id(request) in seen:
            return True
        if remaining[0] == 0:
            return False
        remaining[0] -= 1
        seen.add(id(request))
        times.append(time.monotonic())
        return True

    return pick


def inject(
    kmock: KubeEmulator, name: str, times: list[float], status: int, count: int | list[int]
) -> None:
    """The next `count` writes of Deployment `name` are answered `status`."""
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": f"injected {status}", "code": status}  # fmt: skip
    kmock[next_writes(name, times, count)] << status << body


async def test_409_and_500_are_retried_with_backoff_not_a_storm(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    attempts: dict[str, list[float]] = {"conflict": [], "error": []}
    for name in attempts:
        await create_isvc(kmock, name, BUILTIN)
    for name in attempts:
        await eventually(lambda n=name: live(kmock, DEPLOYMENT, n), timeout=60)
        await eventually(lambda n=name: condition(kmock, n, "Ready"), timeout=30)
    # Each Deployment's next write (the spec change below) fails first.
    inject(kmock, "conflict", attempts["conflict"], 409, 2)
    inject(kmock, "error", attempts["error"], 500, 2)
    before = {name: len(applies(kmock, name)) for name in attempts}
    started = time.monotonic()
    for name in attempts:
        await api(kmock, "PATCH", f"{ISVC_PATH}/{name}", {"spec": {"engine": {"maxNumSeqs": 4}}})
    for name in attempts:
        await eventually(
            lambda n=name: "4" in engine_args(live(kmock, DEPLOYMENT, n)),
            timeout=60,  # type: ignore[arg-type]
        )
        # kmock stores a write even when a reaction answers it with an error (as a real server
        # may have applied a write whose answer was lost), so the Deployment alone proves little.
        # A reconcile whose write failed stops before the status: the status of the new
        # generation is written only by a retry that went through.
        await eventually(
            lambda n=name: (
                live(kmock, ISVC, n)["status"]["observedGeneration"]  # type: ignore[index]
                == live(kmock, ISVC, n)["metadata"]["generation"]
            ),  # type: ignore[index]
            timeout=60,
        )
    assert [len(attempts[n]) for n in attempts] == [2, 2]  # every injected fault was hit
    elapsed = time.monotonic() - started
    for name in attempts:
        count = len(applies(kmock, name)) - before[name]
        # A storm would be dozens of writes a second; here: the faults, one success, and at most
        # a retry per resync period in flight at that moment.
        assert count <= len(attempts[name]) + 3, (name, count, elapsed)
    # Once converged, quiet: resyncs make no further writes.
    counts = {name: len(applies(kmock, name)) for name in attempts}
    await asyncio.sleep(3 * operator.config.resync_seconds)
    assert {name: len(applies(kmock, name)) for name in attempts} == counts
    assert operator.thread.is_alive()
