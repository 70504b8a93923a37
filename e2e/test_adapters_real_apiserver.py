"""LoRA adapters on a real kube-apiserver and kube-controller-manager: adding and removing
spec.adapters loads and unloads them in the running engine, with no new ReplicaSet and no new
Pod; a corrupt adapter is Failed with the engine's 400, a condition and a Warning Event, and the
base model keeps answering.

Everything but the node is real: the CRD as crds/ ships it (schema, CEL rules, defaulting by the
API server), the operator (kopf and our handlers, in-process, watching a namespace of its own),
the Deployment and ReplicaSet controllers, and `kvpilot serve` on a tiny random Llama with PEFT
adapters. The node is kubelet_standin.KubeletStandIn: it binds the pod, runs the engine with
the pod's own command line (only --host and --port changed to 127.0.0.N and a free port; the
model is a file:// path, so the pod's --model is this machine's directory), and reports it Ready.

Needs KUBECONFIG pointing at a control plane without a node agent; see operator/README.md
("LoRA adapters") for how to start one on this machine.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from kvpilot.operator.cli import run_operator
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.constants import MODEL_CACHE_MOUNT

from .cluster import wait_for
from .conftest import GROUP, PLURAL, ROOT, VERSION
from .kubelet_standin import KubeletStandIn, LocalContainer
from .lora_models import LoraModels, make_lora_models, tiny_lora_spec

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NAME = "tiny"
CRD_NAME = f"{PLURAL}.{GROUP}"
SYNC_S = 1.0
START_S = 240.0  # the engine process's start on a busy 2-core machine
CHANGE_S = 30.0  # a spec change reaching the engine: a few sync rounds
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> LoraModels:
    return make_lora_models(tmp_path_factory.mktemp("lora-real-apiserver"))


@pytest.fixture()
def namespace(apis: dict[str, Any]) -> Iterator[str]:
    from kubernetes import client

    name = f"kvpilot-lora-{uuid.uuid4().hex[:6]}"
    apis["core"].create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    apis["core"].delete_namespace(name)
    # The namespace controller removes what is left (Events, the ServiceAccount).
    wait_for(lambda: not _exists(apis["core"].read_namespace, name), 120, f"{name} to go")


@pytest.fixture()
def crd(apis: dict[str, Any]) -> Iterator[None]:
    """crds/ as shipped; removed again when this test installed it."""
    body = yaml.safe_load((ROOT / "crds" / f"{CRD_NAME}.yaml").read_text())
    ext = apis["ext"]
    try:
        existing = ext.read_custom_resource_definition(CRD_NAME)
    except ApiException as error:
        if error.status != 404:
            raise
        existing = None
    if existing is None:
        ext.create_custom_resource_definition(body)
    else:
        body["metadata"]["resourceVersion"] = existing.metadata.resource_version
        ext.replace_custom_resource_definition(CRD_NAME, body)

    def established() -> bool:
        conditions = ext.read_custom_resource_definition(CRD_NAME).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    wait_for(established, 30, "the CRD to be Established", interval=0.2)
    yield
    if existing is None:
        ext.delete_custom_resource_definition(CRD_NAME)


def free_engine_port(ips: list[str]) -> int:
    """A port free on every one of `ips` (pods share the engine port, each on its own IP)."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        socks = [socket.socket() for _ in ips]
        try:
            for sock, ip in zip(socks, ips, strict=True):
                sock.bind((ip, port))
            return port
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no port free on all the pods' addresses")


@pytest.fixture()
def engine_port() -> int:
    return free_engine_port([f"127.0.0.{n}" for n in range(2, 5)])


def engine_runtime(port: int, scratch: Path) -> Any:
    """The pod's engine container as a local `kvpilot serve`: its args with --host and --port
    replaced, its plain env with the pod's volume paths moved under `scratch`, one torch
    thread; ready when its readinessProbe's path answers 200."""

    def run(pod: dict[str, Any], container: dict[str, Any], ip: str) -> LocalContainer:
        assert container["command"] == ["kvpilot"], container["command"]
        args = list(container["args"])
        for flag, value in (("--host", ip), ("--port", str(port))):
            args[args.index(flag) + 1] = value
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for var in container.get("env") or []:
            value = var.get("value")
            if value is None:
                continue  # valueFrom: none in this test's pods
            if value.startswith(MODEL_CACHE_MOUNT):
                value = str(scratch / pod["metadata"]["name"]) + value
            env[var["name"]] = value
        env["HOME"] = str(scratch)
        path = container["readinessProbe"]["httpGet"]["path"]
        argv = [sys.executable, "-m", "kvpilot.cli", *args]
        return LocalContainer(argv, env, f"http://{ip}:{port}{path}")

    return run


@pytest.fixture()
def kubelet(
    apis: dict[str, Any], namespace: str, engine_port: int, tmp_path: Path
) -> Iterator[KubeletStandIn]:
    standin = KubeletStandIn(
        core=apis["core"],
        namespace=namespace,
        node_name=f"standin-{namespace}",
        runtime=engine_runtime(engine_port, tmp_path),
        log_dir=tmp_path,
    )
    standin.start()
    try:
        yield standin
    finally:
        standin.stop()


@pytest.fixture()
def operator(
    apis: dict[str, Any], crd: None, namespace: str, kubelet: KubeletStandIn, engine_port: int
) -> Iterator[OperatorConfig]:
    config = OperatorConfig(
        namespaces=(namespace,),
        engine_image="kvpilot:standin",
        resync_seconds=2.0,
        liveness_endpoint=None,
        metrics_port=0,
        adapter_sync_seconds=SYNC_S,
        adapter_load_timeout_seconds=60.0,
        engine_metrics_port=engine_port,
    )
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=run_operator,
        args=(config,),
        kwargs={"stop_flag": stop, "ready_flag": ready},
        daemon=True,
    )
    thread.start()
    assert ready.wait(30), "the operator did not get ready"
    try:
        yield config
    finally:
        # Its finalizer goes with the object only while the operator runs.
        custom = apis["custom"]
        with contextlib.suppress(Exception):
            custom.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        with contextlib.suppress(AssertionError):
            wait_for(
                lambda: (
                    not custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)[
                        "items"
                    ]
                ),
                30,
                "the InferenceServices to go",
                interval=0.2,
            )
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), "the operator did not stop"


def _exists(read: Any, *args: str) -> bool:
    try:
        read(*args)
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


class View:
    """What the real API server shows of the test's InferenceService and its children."""

    def __init__(self, apis: dict[str, Any], namespace: str, kubelet: KubeletStandIn) -> None:
        self.apis, self.namespace, self.kubelet = apis, namespace, kubelet

    def isvc(self) -> dict[str, Any]:
        return self.apis["custom"].get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, NAME
        )

    def patch_adapters(self, adapters: list[dict[str, str]]) -> None:
        self.apis["custom"].patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, NAME, {"spec": {"adapters": adapters}}
        )

    def adapters(self) -> dict[str, dict[str, Any]]:
        status = self.isvc().get("status") or {}
        return {a["name"]: a for a in status.get("adapters") or []}

    def states(self, adapter: str) -> dict[str, str]:
        found = self.adapters().get(adapter) or {}
        return {r["pod"]: r["state"] for r in found.get("replicas") or []}

    def condition(self, type_: str) -> dict[str, Any]:
        conditions = (self.isvc().get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == type_), {})

    def deployment(self) -> Any:
        return self.apis["apps"].read_namespaced_deployment(NAME, self.namespace)

    def replicasets(self) -> list[str]:
        items = self.apis["apps"].list_namespaced_replica_set(self.namespace).items
        return sorted(rs.metadata.name for rs in items)

    def pods(self) -> dict[str, str]:
        items = self.apis["core"].list_namespaced_pod(self.namespace).items
        return {p.metadata.name: p.metadata.uid for p in items}

    def events(self, reason: str) -> list[Any]:
        found = self.apis["core"].list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={NAME}"
        )
        return [e for e in found.items if e.reason == reason]

    def describe(self) -> str:
        status = self.isvc().get("status")
        return f"status={status!r}; kubelet stand-in errors={self.kubelet.errors!r}"

    def until(self, check: Callable[[], Any], what: str, timeout_s: float = CHANGE_S) -> Any:
        return wait_for(check, timeout_s, what, interval=0.25, describe=self.describe)


def served(url: str) -> dict[str, str | None]:
    """The engine's /v1/models: each id and its parent."""
    data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {m["id"]: m.get("parent") for m in data}


def complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_spec_changes_load_and_unload_adapters_without_a_new_replicaset(
    apis: dict[str, Any],
    namespace: str,
    operator: OperatorConfig,
    kubelet: KubeletStandIn,
    models: LoraModels,
) -> None:
    view = View(apis, namespace, kubelet)
    sql = {"name": "sql", "uri": f"file://{models.sql}"}
    chat = {"name": "chat-v2", "uri": f"file://{models.chat}"}
    broken = {"name": "broken", "uri": f"file://{models.broken}"}
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {**tiny_lora_spec(models, max_loras=2), "adapters": [sql]},
    }
    apis["custom"].create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

    # Deployment -> ReplicaSet -> Pod by the controller-manager; the stand-in runs the engine.
    (pod,) = view.until(
        lambda: [p for p in view.pods() if (r := kubelet.running(p)) and r.is_ready],
        "the engine pod to be Ready",
        START_S,
    )
    running = kubelet.running(pod)
    assert running is not None
    url = f"http://{running.ip}:{operator.engine_metrics_port}"
    args = apis["core"].read_namespaced_pod(pod, namespace).spec.containers[0].args
    assert "--enable-lora" in args and "--max-lora-rank" in args
    assert not any(str(models.sql) in arg for arg in args)  # adapters are no pod flag

    view.until(lambda: view.states("sql") == {pod: "Loaded"}, "sql Loaded")
    assert served(url) == {NAME: None, "sql": NAME}
    status = view.isvc()["status"]
    assert status["adapterSummary"] == "1/1"
    assert status["adapters"][0]["uri"] == sql["uri"]
    ready = view.until(lambda: view.condition("AdaptersReady"), "AdaptersReady")
    assert (ready["status"], ready["reason"]) == ("True", "AdaptersLoaded")
    assert complete(url, "sql").status_code == 200

    # The CRD's CEL rules, run by the API server: refused before the operator or a pod sees it.
    for bad, says in (
        ({**chat, "rank": 16}, "an adapter's rank exceeds spec.engine.lora.maxLoraRank"),
        ({**chat, "name": NAME}, "an adapter may not have the served model's name"),
    ):
        with pytest.raises(ApiException) as refused:
            view.patch_adapters([bad])
        assert refused.value.status == 422 and says in refused.value.body, refused.value.body

    deployment = view.deployment()
    generation = deployment.metadata.generation
    serialize = apis["core"].api_client.sanitize_for_serialization
    template = serialize(deployment.spec.template)
    replicasets, pods = view.replicasets(), view.pods()
    assert len(replicasets) == 1 and list(pods) == [pod]

    # Swap sql for chat-v2: the engine unloads one and loads the other; nothing rolls.
    view.patch_adapters([chat])
    view.until(lambda: served(url) == {NAME: None, "chat-v2": NAME}, "chat-v2 in, sql out")
    view.until(
        lambda: set(view.adapters()) == {"chat-v2"} and view.states("chat-v2") == {pod: "Loaded"},
        "the status to show chat-v2 alone",
    )
    assert complete(url, "chat-v2").status_code == 200
    assert complete(url, "sql").status_code == 404
    assert view.condition("AdaptersReady")["status"] == "True"

    # A corrupt adapter: Failed with the engine's 400, a condition and a Warning Event.
    view.patch_adapters([chat, broken])
    view.until(lambda: view.states("broken") == {pod: "Failed"}, "broken Failed")
    (replica,) = view.adapters()["broken"]["replicas"]
    assert replica["message"].startswith("HTTP 400: "), replica
    assert "is not a readable weights file" in replica["message"], replica
    assert "lastAttemptTime" in replica, replica
    ready = view.until(
        lambda: (c := view.condition("AdaptersReady")).get("status") == "False" and c,
        "AdaptersReady=False",
    )
    assert ready["reason"] == "AdapterFailed"
    assert "is not a readable weights file" in ready["message"]
    (event,) = view.until(lambda: view.events("AdapterFailed"), "an AdapterFailed Event")
    assert event.type == "Warning"
    assert f"the engine in {pod} refused adapter broken" in event.message
    # Not asked again each round: the refusal's time survives the status round trip through
    # the API server (a retry would stamp a later second and post another Event).
    time.sleep(4 * SYNC_S)
    assert view.adapters()["broken"]["replicas"] == [replica]
    assert len(view.events("AdapterFailed")) == 1
    assert served(url) == {NAME: None, "chat-v2": NAME}
    answer = complete(url, NAME)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4
    assert view.states("chat-v2") == {pod: "Loaded"}

    # Through both changes: the same Deployment generation and template, the same one
    # ReplicaSet, the same Pod.
    after = view.deployment()
    assert after.metadata.generation == generation
    assert serialize(after.spec.template) == template
    assert view.replicasets() == replicasets
    assert view.pods() == pods
    assert kubelet.errors == []
