"""On a real cluster: the chart's router serves every InferenceService of the namespace on one
URL, sends a shared prefix to the replica holding it, 404s unknown models, streams, and every
router replica stops sending to a pod that is being deleted within its preStop window."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from kvpilot.operator.constants import PRESTOP_SLEEP_SECONDS

from .cluster import (
    ask_routed,
    example_isvc,
    port_forward,
    router_follows,
    router_pods,
    router_routes_to,
    router_tokenizes,
    wait_for,
    wait_ready,
)
from .conftest import GROUP, PLURAL, VERSION, E2ESettings

pytestmark = pytest.mark.k8s

NAME = "routed"
ROUTER_SERVICE = "kvpilot-router"
ROUTER = f"svc/{ROUTER_SERVICE}"
ROUTER_REPLICAS = 2  # the chart's default
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
        # Until it holds the model's tokenizer (fetched from a replica in the background), a
        # router routes by load alone, by design: no prefix routes to ask for before that.
        wait_for(lambda: router_tokenizes(base, NAME), 60, "the router to load the tokenizer")
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

        # The holder is deleted. Each router replica (the Service spreads clients over all of
        # them) stops sending to it while its preStop hook still keeps it serving: before the
        # hook's sleep is over, when the engine starts draining.
        routers = router_pods(apis, e2e.operator_namespace, ROUTER_SERVICE)
        assert len(routers) == ROUTER_REPLICAS, routers
        with contextlib.ExitStack() as forwards:
            bases = []
            for pod, port in routers.items():
                local = forwards.enter_context(
                    port_forward(e2e.operator_namespace, f"pod/{pod}", port)
                )
                bases.append(f"http://127.0.0.1:{local}")
            wait_for(
                lambda: all(router_follows(each, NAME, 2) for each in bases),
                60,
                "every router replica to follow both replicas",
            )
            apis["core"].delete_namespaced_pod(holder, e2e.namespace)
            wait_for(
                lambda: not any(router_routes_to(each, NAME, holder) for each in bases),
                PRESTOP_SLEEP_SECONDS,
                f"every router replica to stop routing to {holder}",
                interval=0.1,
            )
            for each in bases:
                routed = openai.OpenAI(base_url=f"{each}/v1", api_key="unused", max_retries=0)
                for question in ("Are dogs allowed?", "Any discounts?"):
                    replica, _, _ = ask_routed(routed, NAME, SYSTEM, question)
                    assert replica != holder
