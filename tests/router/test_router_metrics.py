"""RouterMetrics' families: exactly the names, types, help texts and labels scrapers read."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.router.metrics import RouterMetrics

# attribute: (name, type, help, label names). The operator's autoscaler reads held_requests and
# in_flight_requests by name, with the InferenceService's labels.
ROUTER_FAMILIES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "decisions": (
        "kvpilot_router_decisions",
        "counter",
        "Routing decisions, by why the replica was chosen (prefix, adapter, load, affinity, "
        "fallback)",
        ("model", "reason"),
    ),
    "adapter_routes": (
        "kvpilot_router_adapter_routes",
        "counter",
        "Requests for LoRA adapters, by the adapter's state on the chosen replica "
        "(resident, free, evict, off)",
        ("model", "slot"),
    ),
    "prefix_match_tokens": (
        "kvpilot_router_prefix_match_tokens",
        "histogram",
        "Prompt tokens the chosen replica already held in its prefix cache",
        ("model",),
    ),
    "held": (
        "kvpilot_router_held_requests",
        "gauge",
        "Requests held for a model with no routable replica (scale from zero)",
        ("model", "namespace", "inferenceservice"),
    ),
    "hold_seconds": (
        "kvpilot_router_hold_seconds",
        "histogram",
        "How long requests were held before a replica took them",
        ("model",),
    ),
    "hold_rejections": (
        "kvpilot_router_hold_rejections",
        "counter",
        "Held requests answered 503 (queue full or hold timeout)",
        ("model", "why"),
    ),
    "in_flight": (
        "kvpilot_router_in_flight_requests",
        "gauge",
        "Requests this router has sent to replicas and not yet seen finish",
        ("model", "namespace", "inferenceservice"),
    ),
    "upstream_errors": (
        "kvpilot_router_upstream_errors",
        "counter",
        "Failures talking to replicas (connect, status, broken stream)",
        ("model", "kind"),
    ),
    "wake_requests": (
        "kvpilot_router_wake_requests",
        "counter",
        "Times this router asked the operator to scale a model up from zero",
        ("model",),
    ),
    "engine_unauthorized": (
        "kvpilot_router_engine_unauthorized",
        "counter",
        "Answers 401 from replicas to the router, by the path refused (kv-events, proxy, "
        "tokenizer)",
        ("model", "path"),
    ),
    "engine_key_read_errors": (
        "kvpilot_router_engine_key_read_errors",
        "counter",
        "Failed reads of the Secrets holding the engines' API keys, by why",
        ("namespace", "secret", "why"),
    ),
    "replicas": (
        "kvpilot_router_replicas",
        "gauge",
        "Replicas known to the router, by whether they are routable",
        ("model", "state"),
    ),
    "tenant_requests": (
        "kvpilot_router_tenant_requests",
        "counter",
        "Requests of each tenant answered, by model id and HTTP status",
        ("tenant", "model", "code"),
    ),
    "tenant_tokens": (
        "kvpilot_router_tenant_tokens",
        "counter",
        "Tokens of each tenant (kind: prompt or completion), as the engines counted them",
        ("tenant", "model", "kind"),
    ),
    "tenant_rejections": (
        "kvpilot_router_tenant_rejections",
        "counter",
        'Requests refused, by tenant ("" when no tenant was authenticated) and reason',
        ("tenant", "reason"),
    ),
    "tenant_queued": (
        "kvpilot_router_tenant_queued",
        "gauge",
        "Requests of each tenant waiting in the router's fair queues for a saturated model",
        ("tenant",),
    ),
    "tenant_queue_seconds": (
        "kvpilot_router_tenant_queue_seconds",
        "histogram",
        "How long each tenant's requests waited in the fair queue before a replica took them",
        ("tenant",),
    ),
    "quota_store_up": (
        "kvpilot_router_quota_store_up",
        "gauge",
        "1 while the shared quota store answers (0: tenants fail open or closed as they chose)",
        (),
    ),
}


def test_every_family_is_exactly_its_row() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    for attribute, (_, _, _, labels) in ROUTER_FAMILIES.items():
        # One series each, by label name: a renamed label fails here.
        if labels:
            getattr(metrics, attribute).labels(**dict.fromkeys(labels, "x"))
    exported = {
        (f.name, f.type, f.documentation, tuple(sorted({k for s in f.samples for k in s.labels})))
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        if not f.name.endswith("_created")
    }
    want = {
        (name, kind, doc, tuple(sorted({*labels, "le"} if kind == "histogram" else labels)))
        for name, kind, doc, labels in ROUTER_FAMILIES.values()
    }
    assert exported == want
