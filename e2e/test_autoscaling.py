"""On a real cluster: load on the autoscaled CPU example scales it from 1 to 2 replicas and back.

The operator scrapes the engine pods' own /metrics; the load comes through a port-forward (to
one pod: enough to queue requests on it). Takes a few minutes: two model loads, and the
example's 60 s scale-down window.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import yaml

from .cluster import get_isvc, port_forward, wait_for, wait_ready
from .conftest import GROUP, PLURAL, ROOT, VERSION, E2ESettings

pytestmark = pytest.mark.k8s

EXAMPLE = ROOT / "examples" / "smollm2-cpu-autoscaling.yaml"
# More concurrent requests than the example's maxNumSeqs (8) plus its targetQueueDepth (4) on
# one pod: the queue stays well above target for as long as the load runs.
NUM_CLIENTS = 32


@pytest.fixture(scope="module")
def autoscaled(release: str, e2e: E2ESettings, apis: dict[str, Any]) -> Iterator[str]:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["namespace"] = e2e.namespace
    name = body["metadata"]["name"]
    apis["custom"].create_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, body)
    yield name
    with contextlib.suppress(Exception):
        apis["custom"].delete_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, name)


@contextlib.contextmanager
def chat_load(base_url: str, model: str) -> Iterator[list[int]]:
    """NUM_CLIENTS clients chatting in a loop until the block ends; yields [num replies]."""
    from openai import OpenAI

    stop = threading.Event()
    num_replies = [0]

    def client_loop() -> None:
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
        while not stop.is_set():
            with contextlib.suppress(Exception):  # a dropped connection: just send the next
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "Tell me a long story about a ship."}],
                    max_tokens=256,
                )
                num_replies[0] += 1

    pool = ThreadPoolExecutor(NUM_CLIENTS)
    for _ in range(NUM_CLIENTS):
        pool.submit(client_loop)
    try:
        yield num_replies
    finally:
        # No waiting for the requests in flight: closing the port-forward next drops them.
        stop.set()
        pool.shutdown(wait=False)


def replicas(apis: dict[str, Any], e2e: E2ESettings, name: str) -> int:
    return apis["apps"].read_namespaced_deployment(name, e2e.namespace).spec.replicas


def event_reasons(apis: dict[str, Any], e2e: E2ESettings, name: str) -> list[str]:
    events = apis["core"].list_namespaced_event(
        e2e.namespace,
        field_selector=f"involvedObject.name={name},involvedObject.kind=InferenceService",
    )
    return [event.reason for event in events.items]


def autoscaling_status(apis: dict[str, Any], e2e: E2ESettings, name: str) -> dict[str, Any]:
    return (get_isvc(apis, e2e, name).get("status") or {}).get("autoscaling") or {}


def test_load_scales_the_cpu_example_from_one_to_two_replicas_and_back(
    autoscaled: str, e2e: E2ESettings, apis: dict[str, Any]
) -> None:
    name = autoscaled
    created = wait_ready(apis, e2e, name)
    generation = created["metadata"]["generation"]
    assert replicas(apis, e2e, name) == 1  # minReplicas
    wait_for(
        lambda: autoscaling_status(apis, e2e, name).get("metrics", {}).get("reportingPods") == 1,
        120,
        "the autoscaler to read the engine's metrics",
        describe=lambda: autoscaling_status(apis, e2e, name),
    )

    with (
        port_forward(e2e.namespace, f"svc/{name}", 8000) as port,
        chat_load(f"http://127.0.0.1:{port}/v1", name) as num_replies,
    ):
        wait_for(
            lambda: replicas(apis, e2e, name) == 2,
            180,
            "the load to scale the Deployment to 2",
            describe=lambda: autoscaling_status(apis, e2e, name),
        )
        # Keep the load on until the new replica serves, so that it scales back from 2 Ready.
        wait_for(
            lambda: (get_isvc(apis, e2e, name).get("status") or {}).get("readyReplicas") == 2,
            e2e.timeout_s,
            "the second replica to become Ready",
            interval=5,
            describe=lambda: get_isvc(apis, e2e, name).get("status"),
        )
        assert replicas(apis, e2e, name) == 2  # maxReplicas: no further
        # A 256-token reply takes a while on a busy node: the load stays on until one is back.
        wait_for(lambda: num_replies[0] > 0, e2e.timeout_s, "a reply to the load", interval=1)
    assert num_replies[0] > 0, "the load got no replies"
    scaled_up = autoscaling_status(apis, e2e, name)["decisions"]
    assert any(d["fromReplicas"] == 1 and d["toReplicas"] == 2 for d in scaled_up), scaled_up

    # The queue drains: back to 1 after the example's 60 s scale-down window.
    wait_for(
        lambda: replicas(apis, e2e, name) == 1,
        300,
        "the Deployment to scale back to 1",
        interval=5,
        describe=lambda: autoscaling_status(apis, e2e, name),
    )
    state = autoscaling_status(apis, e2e, name)
    assert state["decisions"][-1]["toReplicas"] == 1
    assert state["decisions"][-1]["reason"] == "ScaleDown"
    wait_for(
        lambda: {"ScaledUp", "ScaledDown"} <= set(event_reasons(apis, e2e, name)),
        60,
        "the ScaledUp and ScaledDown Events",
        describe=lambda: event_reasons(apis, e2e, name),
    )
    # The operator scaled the Deployment, never the user's object (GitOps stays in sync).
    obj = get_isvc(apis, e2e, name)
    assert obj["metadata"]["generation"] == generation
    assert "replicas" not in obj["spec"]
    assert obj["status"]["desiredReplicas"] == 1


def test_the_operator_reports_its_decisions_on_its_metrics_endpoint(
    release: str, e2e: E2ESettings
) -> None:
    import httpx

    with port_forward(e2e.operator_namespace, "deploy/kvpilot", 8081) as port:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert "kvpilot_operator_scale_decisions_total" in text
    assert 'direction="up"' in text and 'direction="down"' in text
    assert "kvpilot_operator_reconcile_duration_seconds_count" in text
