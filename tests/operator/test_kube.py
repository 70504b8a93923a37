"""kube.KubeApi through the real kubernetes client against the emulator (no kopf)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator.kube import KubeApi, KubeError, connect

from .conftest import DEPLOYMENTS_PATH, ISVC_PATH, NAMESPACE, PODS_PATH
from .kube_emulator import KubeEmulator

pytestmark = pytest.mark.kmock(cls=KubeEmulator)


def deployment(image: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": NAMESPACE, "labels": {"a": "b"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": image}]},
            },
        },
    }


def stored(kmock: KubeEmulator, resource: str, name: str) -> dict[str, Any]:
    return kmock.objects[kmock.resource(resource), NAMESPACE, name].raw


async def test_apply_creates_then_patches(kmock: KubeEmulator, kubeconfig: Path) -> None:
    api = KubeApi(connect())
    created = await asyncio.to_thread(api.apply, deployment("one:1"))
    assert created["metadata"]["uid"]
    # Server-side apply first (a real API server creates with it); the emulator says 404 and
    # the create fallback follows.
    assert [r.method for r in kmock._requests] == ["PATCH", "POST"]
    assert kmock._requests[0].headers["Content-Type"] == "application/apply-patch+yaml"
    assert kmock._requests[0].params == {"fieldManager": "kvpilot-operator", "force": "true"}

    updated = await asyncio.to_thread(api.apply, deployment("two:2"))
    assert updated["metadata"]["uid"] == created["metadata"]["uid"]
    image = stored(kmock, "apps/v1/deployments", "web")["spec"]["template"]["spec"]
    assert image["containers"][0]["image"] == "two:2"
    got = await asyncio.to_thread(api.get, "Deployment", NAMESPACE, "web")
    assert got is not None and got["metadata"]["uid"] == created["metadata"]["uid"]
    assert await asyncio.to_thread(api.get, "Service", NAMESPACE, "web") is None


async def test_dry_run_apply_answers_without_writing(kmock: KubeEmulator, kubeconfig: Path) -> None:
    api = KubeApi(connect())
    assert await asyncio.to_thread(api.dry_run_apply, deployment("one:1")) is None  # no object
    created = await asyncio.to_thread(api.apply, deployment("one:1"))

    answer = await asyncio.to_thread(api.dry_run_apply, deployment("two:2"))
    assert answer is not None
    assert answer["spec"]["template"]["spec"]["containers"][0]["image"] == "two:2"
    # The server's form: defaults filled in (the emulator stores as the API server does).
    assert answer["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    request = kmock._requests[-1]
    assert request.params == {"fieldManager": "kvpilot-operator", "force": "true", "dryRun": "All"}
    assert request.headers["Content-Type"] == "application/apply-patch+yaml"
    # Nothing was written.
    live = stored(kmock, "apps/v1/deployments", "web")
    assert live["spec"]["template"]["spec"]["containers"][0]["image"] == "one:1"
    assert live["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]


async def test_apply_survives_a_create_race(kmock: KubeEmulator, kubeconfig: Path) -> None:
    await kmock.post(DEPLOYMENTS_PATH, json=deployment("theirs:1"))
    # The first apply sees 404 (the object appeared meanwhile), the create then sees 409:
    # apply must go back to server-side apply, not fail.
    kmock[f"patch {DEPLOYMENTS_PATH}/web"][:1] << 404
    api = KubeApi(connect())
    await asyncio.to_thread(api.apply, deployment("ours:1"))
    assert [r.method for r in kmock._requests[1:]] == ["PATCH", "POST", "PATCH"]
    spec = stored(kmock, "apps/v1/deployments", "web")["spec"]["template"]["spec"]
    assert spec["containers"][0]["image"] == "ours:1"


@pytest.mark.parametrize(("status", "is_retryable"), [(503, True), (429, True), (403, False)])
async def test_errors_say_whether_a_retry_can_help(
    kmock: KubeEmulator, kubeconfig: Path, status: int, is_retryable: bool
) -> None:
    kmock[f"get {ISVC_PATH}/x"] << status
    with pytest.raises(KubeError) as caught:
        await asyncio.to_thread(KubeApi(connect()).get_inferenceservice, NAMESPACE, "x")
    assert caught.value.status == status
    assert caught.value.is_retryable is is_retryable


async def test_a_body_that_is_not_json_is_a_retryable_error(
    kmock: KubeEmulator, kubeconfig: Path
) -> None:
    kmock[f"get {ISVC_PATH}/x"] << b"<html>upstream proxy error</html>"
    with pytest.raises(KubeError) as caught:
        await asyncio.to_thread(KubeApi(connect()).get_inferenceservice, NAMESPACE, "x")
    assert caught.value.is_retryable and "not JSON" in str(caught.value)


async def test_unreachable_api_is_retryable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    client = connect()
    client.configuration.retries = 0
    with pytest.raises(KubeError) as caught:
        KubeApi(client).get("Deployment", NAMESPACE, "x")
    assert caught.value.is_retryable and caught.value.status is None


async def test_a_hung_api_server_is_a_retryable_timeout(
    kmock: KubeEmulator, kubeconfig: Path
) -> None:
    await kmock.post(DEPLOYMENTS_PATH, json=deployment("one:1"))
    fault = kmock.inject_fault(lambda r: r.method == "PATCH", 504, count=1, delay=3.0)
    api = KubeApi(connect(), timeout_seconds=0.5)
    with pytest.raises(KubeError) as caught:
        await asyncio.to_thread(api.apply, deployment("two:2"))
    assert caught.value.is_retryable and caught.value.status is None
    assert "timed out" in str(caught.value)
    assert len(fault.hits) == 1  # one write, given up on: urllib3 does not resend a PATCH
    await asyncio.sleep(3.0)  # the hung answer goes out before the emulator stops


async def test_pods_are_listed_by_label(kmock: KubeEmulator, kubeconfig: Path) -> None:
    for name, labels in (("mine", {"app": "x", "i": "1"}), ("other", {"app": "y"})):
        await kmock.post(PODS_PATH, json={"metadata": {"name": name, "labels": labels}})
    pods = await asyncio.to_thread(KubeApi(connect()).list_pods, NAMESPACE, {"app": "x"})
    assert [pod["metadata"]["name"] for pod in pods] == ["mine"]
    assert kmock._requests[-1].params["labelSelector"] == "app=x"


async def test_status_patch_merges_only_the_given_keys(
    kmock: KubeEmulator, kubeconfig: Path
) -> None:
    isvc = {"metadata": {"name": "m", "namespace": NAMESPACE}, "spec": {"replicas": 1}}
    await kmock.post(ISVC_PATH, json=isvc)
    await kmock.patch(
        f"{ISVC_PATH}/m/status",
        json={"status": {"autoscaling": {"mode": "stable"}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    api = KubeApi(connect())
    await asyncio.to_thread(api.patch_inferenceservice_status, NAMESPACE, "m", {"url": "u"})
    status = stored(kmock, "kvpilot.dev/v1alpha1/inferenceservices", "m")["status"]
    assert status == {"autoscaling": {"mode": "stable"}, "url": "u"}
    assert kmock._requests[-1].headers["Content-Type"] == "application/merge-patch+json"
