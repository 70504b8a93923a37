"""On a real cluster, through the chart's router: an InferenceService at zero replicas is woken by
the first request (the router's decision and the operator's scale-up each within 2 s), the held
request is served once the replica is Ready, and the idle service goes back to zero; a model
that cannot become Ready answers 503 with Retry-After when its hold timeout runs out; and
routers restarted mid-run rebuild the same index from the engines' block-event streams and keep
routing a prefix to the replica that holds it.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .cluster import (
    ask_routed,
    example_isvc,
    get_isvc,
    port_forward,
    router_follows,
    router_tokenizes,
    wait_for,
    wait_ready,
)
from .conftest import GROUP, PLURAL, VERSION, E2ESettings

pytestmark = pytest.mark.k8s

ROUTER = "svc/kvpilot-router"
WAKE_ANNOTATION = f"router.{GROUP}/wake-requested-at"
HOLD_TIMEOUT_ANNOTATION = f"{GROUP}/hold-timeout-seconds"
SCALE_TO_ZERO_AFTER_S = 20
SYSTEM = (
    "You are the assistant of a ferry company on the Tagus. Answer in one sentence; timetables "
    "change on Sundays; bicycles travel free; dogs on a lead are welcome on the upper deck."
)


@contextlib.contextmanager
def created(apis: dict[str, Any], e2e: E2ESettings, body: dict[str, Any]) -> Iterator[str]:
    name = body["metadata"]["name"]
    apis["custom"].create_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, body)
    try:
        yield name
    finally:
        with contextlib.suppress(Exception):
            apis["custom"].delete_namespaced_custom_object(
                GROUP, VERSION, e2e.namespace, PLURAL, name
            )


def deployment_replicas(apis: dict[str, Any], e2e: E2ESettings, name: str) -> int | None:
    try:
        return apis["apps"].read_namespaced_deployment(name, e2e.namespace).spec.replicas
    except Exception:
        return None


def test_a_request_wakes_a_service_at_zero_and_is_served(
    release: str, e2e: E2ESettings, apis: dict[str, Any]
) -> None:
    import openai

    body = example_isvc(e2e, "sleepy")
    del body["spec"]["replicas"]
    body["spec"]["autoscaling"] = {
        "minReplicas": 0,
        "maxReplicas": 1,
        "scaleToZeroAfterSeconds": SCALE_TO_ZERO_AFTER_S,
        # Else the default 300 s scale-down window holds the replica long after it is idle.
        "scaleDown": {"stabilizationWindowSeconds": SCALE_TO_ZERO_AFTER_S},
    }
    with created(apis, e2e, body) as name:
        # minReplicas 0: it is created at zero.
        wait_for(
            lambda: deployment_replicas(apis, e2e, name) == 0,
            120,
            "the Deployment at zero replicas",
            describe=lambda: get_isvc(apis, e2e, name).get("status"),
        )
        with port_forward(e2e.operator_namespace, ROUTER, 80) as port:
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1",
                api_key="unused",
                max_retries=0,
                timeout=e2e.timeout_s,
            )
            outcome: dict[str, Any] = {}

            def ask() -> None:
                started = time.monotonic()
                stream = client.chat.completions.create(
                    model=name,
                    messages=[{"role": "user", "content": "Say hello."}],
                    max_tokens=8,
                    stream=True,
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        outcome.setdefault("first_token_s", time.monotonic() - started)
                        outcome["text"] = outcome.get("text", "") + chunk.choices[0].delta.content

            sent_at = datetime.datetime.now(datetime.timezone.utc)
            sent = time.monotonic()
            thread = threading.Thread(target=ask)
            thread.start()

            def wake_annotation() -> str | None:
                annotations = get_isvc(apis, e2e, name)["metadata"].get("annotations") or {}
                return annotations.get(WAKE_ANNOTATION)

            wake = wait_for(wake_annotation, 10, "the router's wake annotation", interval=0.1)
            decided = time.monotonic() - sent
            wait_for(
                lambda: deployment_replicas(apis, e2e, name) == 1,
                10,
                "the operator to scale the Deployment to 1",
                interval=0.1,
            )
            scaled = time.monotonic() - sent
            thread.join(e2e.timeout_s)
            assert not thread.is_alive(), "the held request never finished"
            print(f"wake: decision {decided:.2f} s, scaled {scaled:.2f} s, outcome {outcome}")
            stamp = datetime.datetime.fromisoformat(wake.split()[0])
            assert stamp >= sent_at - datetime.timedelta(seconds=5)  # this request's wake
            assert decided <= 2.0 + 0.1  # the poll interval
            assert scaled <= 2.0 + 0.1
            assert outcome.get("text"), "the held request got no tokens"
        # Idle again: back to zero after scaleToZeroAfterSeconds.
        wait_for(
            lambda: deployment_replicas(apis, e2e, name) == 0,
            SCALE_TO_ZERO_AFTER_S + 120,
            "the idle service to scale back to zero",
            describe=lambda: (get_isvc(apis, e2e, name).get("status") or {}).get("autoscaling"),
        )


def test_a_model_that_cannot_wake_answers_503_with_retry_after_when_the_hold_times_out(
    release: str, e2e: E2ESettings, apis: dict[str, Any]
) -> None:
    import httpx

    body = example_isvc(e2e, "unschedulable")
    del body["spec"]["replicas"]
    body["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 1}
    # More CPU than any test node has: the woken pod stays Pending.
    body["spec"]["resources"]["requests"]["cpu"] = "512"
    body["metadata"]["annotations"] = {HOLD_TIMEOUT_ANNOTATION: "5"}
    with created(apis, e2e, body) as name:
        wait_for(
            lambda: deployment_replicas(apis, e2e, name) == 0,
            e2e.timeout_s,
            "the service to settle at zero",
            describe=lambda: get_isvc(apis, e2e, name).get("status"),
        )
        with port_forward(e2e.operator_namespace, ROUTER, 80) as port:
            started = time.monotonic()
            response = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": name, "messages": [{"role": "user", "content": "hi"}]},
                timeout=60,
            )
            waited = time.monotonic() - started
        assert response.status_code == 503, response.text
        assert int(response.headers["retry-after"]) > 0
        assert response.json()["error"]["code"] == "no_replica"
        assert 5.0 <= waited < 30.0
        # The request still woke it (the pod is Pending, not absent).
        assert deployment_replicas(apis, e2e, name) == 1


def test_routers_restarted_mid_run_rebuild_the_index_and_keep_the_prefix_on_its_holder(
    release: str, e2e: E2ESettings, apis: dict[str, Any]
) -> None:
    import openai

    body = example_isvc(e2e, "remembered")
    body["spec"]["replicas"] = 2
    with created(apis, e2e, body) as name:
        wait_ready(apis, e2e, name)

        def ask(client: openai.OpenAI, question: str) -> tuple[str, str]:
            replica, route, _ = ask_routed(client, name, SYSTEM, question)
            return replica, route

        def client_for(port: int) -> openai.OpenAI:
            return openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
            )

        with port_forward(e2e.operator_namespace, ROUTER, 80) as port:
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda: router_follows(base, name, 2), 60, "the router to follow both")
            holder, _ = ask(client_for(port), "When is the last boat?")

        selector = "app.kubernetes.io/component=router"
        old = {
            p.metadata.name
            for p in apis["core"]
            .list_namespaced_pod(e2e.operator_namespace, label_selector=selector)
            .items
        }
        apis["core"].delete_collection_namespaced_pod(
            e2e.operator_namespace, label_selector=selector
        )

        def new_routers_ready() -> bool:
            pods = apis["core"].list_namespaced_pod(e2e.operator_namespace, label_selector=selector)
            fresh = [p for p in pods.items if p.metadata.name not in old]
            return len(fresh) >= 2 and all(
                any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
                for p in fresh
            )

        wait_for(new_routers_ready, 300, "the restarted routers to be Ready")
        # A fresh router (the port-forward reaches one of them) knows the holder by its index.
        with port_forward(e2e.operator_namespace, ROUTER, 80) as port:
            base = f"http://127.0.0.1:{port}"
            wait_for(
                lambda: router_follows(base, name, 2) and router_tokenizes(base, name),
                60,
                "the new router to follow both and hold the tokenizer",
            )
            for question in ("Can I bring a bicycle?", "Is the upper deck open?", "Sunday?"):
                replica, route = ask(client_for(port), question)
                assert replica == holder and route.startswith("prefix"), (replica, route)
