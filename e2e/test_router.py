"""On a real cluster: the chart's router serves every InferenceService of the namespace on one
URL, sends a shared prefix to the replica holding it, 404s unknown models, streams, and stops
sending to a pod as soon as it is being deleted."""

from __future__ import annotations

from typing import Any

import pytest

from .cluster import ask_routed, example_isvc, port_forward, router_follows, wait_for, wait_ready
from .conftest import GROUP, PLURAL, VERSION, E2ESettings

pytestmark = pytest.mark.k8s

NAME = "routed"
ROUTER = "svc/kvpilot-router"
SYSTEM = (
    "You are the assistant of a bicycle rental shop in Lisbon. Answer in short sentences, never "
    "invent prices, and refer complaints to the manager. Helmets are free with every rental; "
    "electric bicycles need a deposit; children under twelve ride with an adult."
)


def routed_pods(apis: dict[str, Any], e2e: E2ESettings) -> list[str]:
    pods = apis["core"].list_namespaced_pod(
        e2e.namespace, label_selector=f"app.kubernetes.io/instance={NAME}"
    )
    return [p.metadata.name for p in pods.items if p.metadata.deletion_timestamp is None]


def test_router_routes_by_prefix_404s_streams_and_skips_a_deleted_pod(
    release: str, e2e: E2ESettings, apis: dict[str, Any]
) -> None:
    import openai

    body = example_isvc(e2e, NAME)
    body["spec"]["replicas"] = 2
    apis["custom"].create_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, body)
    obj = wait_ready(apis, e2e, NAME)
    # kubectl get isvc shows the URL users call: the router's.
    router_url = f"http://kvpilot-router.{e2e.operator_namespace}.svc:80/v1"
    assert obj["status"]["endpoint"] == router_url
    wait_for(lambda: len(routed_pods(apis, e2e)) == 2, e2e.timeout_s, "two Ready pods")

    with port_forward(e2e.operator_namespace, ROUTER, 80) as port:
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        wait_for(lambda: router_follows(base, NAME, 2), 60, "the router to follow both replicas")
        assert NAME in [m.id for m in client.models.list()]
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )

        def ask(question: str) -> tuple[str, str, int]:
            return ask_routed(client, NAME, SYSTEM, question)

        holder, _, _ = ask("Do you rent tandems?")
        for question in ("Is there parking?", "Can I pay by card?"):
            replica, route, cached = ask(question)
            assert replica == holder and route.startswith("prefix") and cached > 0

        stream = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "Count to twenty."}],
            max_tokens=24,
            stream=True,
        )
        chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
        assert len(chunks) > 5

        # The holder is deleted: the router stops sending to it at once (deletionTimestamp),
        # while its preStop hook still keeps it serving.
        apis["core"].delete_namespaced_pod(holder, e2e.namespace)
        for question in ("Are dogs allowed?", "Do you open on Sunday?", "Any discounts?"):
            replica, _, _ = ask(question)
            assert replica != holder
