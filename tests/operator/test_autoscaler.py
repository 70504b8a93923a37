"""Autoscaler.run, the API calls around one tick, over an in-memory API and the real Reconciler.

What the emulated-cluster test cannot pin down exactly: which calls a skipped tick makes (none),
and that nothing is written or announced when the object changed under the tick.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest

from kvpilot.operator.autoscaler import Autoscaler
from kvpilot.operator.autoscaling import AutoscalingPolicy, PodMetrics, ScrapeTarget
from kvpilot.operator.autoscaling.scrape import ScrapeResult
from kvpilot.operator.builders import selector_labels
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.kube import KubeError
from kvpilot.operator.reconcile import Reconciler

from .autoscaling_helpers import merge_patch, pod_dict

NOW = 1_750_000_000.0
UID = "uid-chat"


def isvc(generation: int = 1, **autoscaling: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "serving", "uid": UID, "generation": generation},
        "spec": {
            "model": {"uri": "builtin://smollm2-135m-instruct"},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 4, **autoscaling},
        },
        "status": {},
    }


def deployment(replicas: int, owner_uid: str = UID) -> dict[str, Any]:
    owner = {"kind": "InferenceService", "name": "chat", "uid": owner_uid, "controller": True}
    return {
        "metadata": {"name": "chat", "namespace": "serving", "ownerReferences": [owner]},
        "spec": {"replicas": replicas},
    }


class MemoryApi:
    """The KubeApi calls the autoscaler makes, on dicts; every call is logged."""

    def __init__(self, body: dict[str, Any] | None, live: dict[str, Any] | None) -> None:
        self.body = body
        self.live = live
        self.pods = [pod_dict(f"chat-{i}", f"10.0.0.{i}", created=NOW - 60) for i in range(2)]
        self.calls: list[str] = []
        self.fail_on: str | None = None

    def _log(self, call: str) -> None:
        self.calls.append(call)
        if call == self.fail_on:
            raise KubeError("API error 503", status=503, is_retryable=True)

    def get_inferenceservice(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._log("get_inferenceservice")
        return copy.deepcopy(self.body)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._log(f"get {kind}")
        return copy.deepcopy(self.live)

    def list_pods(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        self._log("list_pods")
        assert selector == selector_labels("chat")
        return copy.deepcopy(self.pods)

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        self._log("scale_deployment")
        assert self.live is not None
        self.live["spec"]["replicas"] = replicas

    def patch_inferenceservice_status(
        self, namespace: str, name: str, status: dict[str, Any]
    ) -> None:
        self._log("patch_status")
        assert self.body is not None
        merge_patch(self.body.setdefault("status", {}), copy.deepcopy(status))


def waiting(num: float) -> Any:
    async def scrape(targets: Sequence[ScrapeTarget]) -> dict[str, ScrapeResult]:
        return {t.name: PodMetrics(num_waiting=num, kv_cache_usage=0.1) for t in targets}

    return scrape


def autoscaler(api: MemoryApi, num_waiting: float = 0.0) -> tuple[Autoscaler, list[tuple]]:
    events: list[tuple] = []

    def post(body: Any, type_: str, reason: str, message: str) -> None:
        events.append((body["metadata"]["name"], type_, reason, message))

    reconciler = Reconciler(api, OperatorConfig(), post)  # type: ignore[arg-type]
    scaler = Autoscaler(api, reconciler, waiting(num_waiting), post, clock=lambda: NOW)  # type: ignore[arg-type]
    return scaler, events


async def test_a_burst_scales_the_deployment_writes_status_and_announces_it() -> None:
    api = MemoryApi(isvc(), deployment(2))
    scaler, events = autoscaler(api, num_waiting=15)  # 3x the target on each of 2 pods
    result = await scaler.run(api.body)  # type: ignore[arg-type]
    assert result is not None and result.replicas == 4  # x2 per step, within maxReplicas
    assert api.live["spec"]["replicas"] == 4  # type: ignore[index]
    status = api.body["status"]  # type: ignore[index]
    assert status["desiredReplicas"] == 4
    assert status["autoscaling"]["decisions"][-1]["reason"] == "PanicScaleUp"
    assert status["autoscaling"]["window"]["lastTick"] == NOW
    assert [e[:3] for e in events] == [("chat", "Normal", "ScaledUp")]
    # Deployment first, then status; the spec is not among the writes.
    writes = [c for c in api.calls if c in ("scale_deployment", "patch_status")]
    assert writes == ["scale_deployment", "patch_status"]


async def test_a_steady_tick_writes_status_only() -> None:
    api = MemoryApi(isvc(), deployment(2))
    scaler, events = autoscaler(api, num_waiting=5)  # exactly at target
    result = await scaler.run(api.body)  # type: ignore[arg-type]
    assert result is not None and result.replicas is None
    assert "scale_deployment" not in api.calls
    assert api.body["status"]["desiredReplicas"] == 2  # type: ignore[index]
    assert events == []


async def test_no_api_call_while_kopfs_copy_says_the_interval_has_not_passed() -> None:
    body = isvc(intervalSeconds=30)
    body["status"] = {"autoscaling": {"window": {"lastTick": NOW - 10}}}
    api = MemoryApi(body, deployment(2))
    scaler, _ = autoscaler(api)
    assert await scaler.run(body) is None
    assert api.calls == []


async def test_the_fresh_object_decides_not_kopfs_copy() -> None:
    stale = isvc()  # kopf's copy predates the last tick's status write
    fresh = isvc()
    fresh["status"] = {"autoscaling": {"window": {"lastTick": NOW - 1}}}
    api = MemoryApi(fresh, deployment(2))
    scaler, _ = autoscaler(api)
    assert await scaler.run(stale) is None
    assert api.calls == ["get_inferenceservice"]


@pytest.mark.parametrize(
    ("fresh", "live"),
    [
        (None, deployment(2)),  # deleted meanwhile
        ({**isvc(2), "spec": {"model": {"uri": "builtin://smollm2-135m-instruct"}}}, deployment(2)),
        (isvc(), None),  # reconcile has not created the Deployment yet
        (isvc(), deployment(2, owner_uid="someone-else")),  # not ours
    ],
    ids=["deleted", "autoscaling-off", "no-deployment", "foreign-deployment"],
)
async def test_nothing_is_written_when_there_is_nothing_to_scale(
    fresh: dict[str, Any] | None, live: dict[str, Any] | None
) -> None:
    api = MemoryApi(fresh, live)
    scaler, events = autoscaler(api, num_waiting=50)
    assert await scaler.run(isvc()) is None
    assert not {"scale_deployment", "patch_status"} & set(api.calls)
    assert events == []


async def test_a_spec_broken_under_the_tick_is_left_to_reconcile() -> None:
    # Valid in kopf's copy; the fresh one is invalid (the panic window exceeds the stable one):
    # the tick computes nothing to apply, and reconcile reports InvalidSpec.
    api = MemoryApi(isvc(2, panicWindowSeconds=30), deployment(2))
    scaler, events = autoscaler(api, num_waiting=50)
    assert await scaler.run(isvc()) is None
    assert not {"scale_deployment", "patch_status"} & set(api.calls)
    assert events == []
    # Invalid in kopf's copy too: not even a read.
    api.calls.clear()
    assert await scaler.run(isvc(2, panicWindowSeconds=30)) is None
    assert api.calls == []


class EditedDuringTheTick(MemoryApi):
    """The user edits the spec (generation 2) while the tick scrapes its pods."""

    def list_pods(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        pods = super().list_pods(namespace, selector)
        assert self.body is not None
        self.body = isvc(2, maxReplicas=2)
        return pods


async def test_a_decision_on_a_spec_edited_meanwhile_is_not_applied() -> None:
    api = EditedDuringTheTick(isvc(), deployment(2))
    scaler, events = autoscaler(api, num_waiting=50)
    assert await scaler.run(isvc()) is None
    assert not {"scale_deployment", "patch_status"} & set(api.calls)
    assert events == []


async def test_one_tick_parses_the_settings_once(monkeypatch: pytest.MonkeyPatch) -> None:
    num_parses = 0
    original = AutoscalingPolicy.from_spec.__func__  # type: ignore[attr-defined]

    def counting(cls: type[AutoscalingPolicy], autoscaling: Any) -> AutoscalingPolicy:
        nonlocal num_parses
        num_parses += 1
        return original(cls, autoscaling)

    monkeypatch.setattr(AutoscalingPolicy, "from_spec", classmethod(counting))
    api = MemoryApi(isvc(), deployment(2))
    scaler, _ = autoscaler(api, num_waiting=50)
    result = await scaler.run(isvc())
    assert result is not None and result.replicas == 4
    assert num_parses == 1


@pytest.mark.parametrize("failing", ["get_inferenceservice", "list_pods", "scale_deployment"])
async def test_api_errors_are_left_to_the_next_tick(failing: str) -> None:
    api = MemoryApi(isvc(), deployment(2))
    api.fail_on = failing
    scaler, events = autoscaler(api, num_waiting=50)
    assert await scaler.run(api.body) is None  # type: ignore[arg-type]
    assert "patch_status" not in api.calls
    assert events == []
