"""The router's Prometheus metrics (GET /metrics on the router)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.contract.load_metrics import ROUTER_HELD_REQUESTS, ROUTER_IN_FLIGHT_REQUESTS
from kvpilot.contract.prometheus import Family

PREFIX_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
HOLD_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)

DECISIONS = Family(
    Counter,
    "kvpilot_router_decisions",
    "Routing decisions, by why the replica was chosen (prefix, adapter, load, affinity, fallback)",
    ("model", "reason"),
)
PREFIX_MATCH_TOKENS = Family(
    Histogram,
    "kvpilot_router_prefix_match_tokens",
    "Prompt tokens the chosen replica already held in its prefix cache",
    ("model",),
    buckets=PREFIX_BUCKETS,
)
ADAPTER_ROUTES = Family(
    Counter,
    "kvpilot_router_adapter_routes",
    "Requests for LoRA adapters, by the adapter's state on the chosen replica "
    "(resident, free, evict, off)",
    ("model", "slot"),
)
# The InferenceService's labels: the operator's autoscaler adds these to its queue.
HELD_REQUESTS = ROUTER_HELD_REQUESTS
HOLD_SECONDS = Family(
    Histogram,
    "kvpilot_router_hold_seconds",
    "How long requests were held before a replica took them",
    ("model",),
    buckets=HOLD_BUCKETS,
)
HOLD_REJECTIONS = Family(
    Counter,
    "kvpilot_router_hold_rejections",
    "Held requests answered 503 (queue full or hold timeout)",
    ("model", "why"),
)
IN_FLIGHT_REQUESTS = ROUTER_IN_FLIGHT_REQUESTS
UPSTREAM_ERRORS = Family(
    Counter,
    "kvpilot_router_upstream_errors",
    "Failures talking to replicas (connect, status, broken stream)",
    ("model", "kind"),
)
# A replica refusing the router's key (401): its event stream (prefix awareness lost), a proxied
# request or its tokenizer. path: kv-events, proxy or tokenizer.
ENGINE_UNAUTHORIZED = Family(
    Counter,
    "kvpilot_router_engine_unauthorized",
    "Answers 401 from replicas to the router, by the path refused (kv-events, proxy, tokenizer)",
    ("model", "path"),
)
# Reading an InferenceService's engine API key (spec.engine.apiKeySecret) failed: result is
# forbidden, missing (no such Secret or key) or error.
ENGINE_KEY_READ_ERRORS = Family(
    Counter,
    "kvpilot_router_engine_key_read_errors",
    "Failed reads of the Secrets holding the engines' API keys, by why",
    ("namespace", "secret", "why"),
)
WAKE_REQUESTS = Family(
    Counter,
    "kvpilot_router_wake_requests",
    "Times this router asked the operator to scale a model up from zero",
    ("model",),
)
# Per tenant (its `namespace/name`): what the platform bills and watches (the chart's dashboard
# has a row of these).
TENANT_REQUESTS = Family(
    Counter,
    "kvpilot_router_tenant_requests",
    "Requests of each tenant answered, by model id and HTTP status",
    ("tenant", "model", "code"),
)
TENANT_TOKENS = Family(
    Counter,
    "kvpilot_router_tenant_tokens",
    "Tokens of each tenant (kind: prompt or completion), as the engines counted them",
    ("tenant", "model", "kind"),
)
TENANT_REJECTIONS = Family(
    Counter,
    "kvpilot_router_tenant_rejections",
    'Requests refused, by tenant ("" when no tenant was authenticated) and reason',
    ("tenant", "reason"),
)
TENANT_QUEUED = Family(
    Gauge,
    "kvpilot_router_tenant_queued",
    "Requests of each tenant waiting in the router's fair queues for a saturated model",
    ("tenant",),
)
TENANT_QUEUE_SECONDS = Family(
    Histogram,
    "kvpilot_router_tenant_queue_seconds",
    "How long each tenant's requests waited in the fair queue before a replica took them",
    ("tenant",),
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
QUOTA_STORE_UP = Family(
    Gauge,
    "kvpilot_router_quota_store_up",
    "1 while the shared quota store answers (0: tenants fail open or closed as they chose)",
    (),
)
REPLICAS = Family(
    Gauge,
    "kvpilot_router_replicas",
    "Replicas known to the router, by whether they are routable",
    ("model", "state"),
)


class RouterMetrics:
    """The router's families, registered on `registry` (the caller's, served on /metrics)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.decisions = DECISIONS.declare(registry)
        self.prefix_match_tokens = PREFIX_MATCH_TOKENS.declare(registry)
        self.adapter_routes = ADAPTER_ROUTES.declare(registry)
        self.held = HELD_REQUESTS.declare(registry)
        self.hold_seconds = HOLD_SECONDS.declare(registry)
        self.hold_rejections = HOLD_REJECTIONS.declare(registry)
        self.in_flight = IN_FLIGHT_REQUESTS.declare(registry)
        self.upstream_errors = UPSTREAM_ERRORS.declare(registry)
        self.wake_requests = WAKE_REQUESTS.declare(registry)
        self.engine_unauthorized = ENGINE_UNAUTHORIZED.declare(registry)
        self.engine_key_read_errors = ENGINE_KEY_READ_ERRORS.declare(registry)
        self.replicas = REPLICAS.declare(registry)
        self.tenant_requests = TENANT_REQUESTS.declare(registry)
        self.tenant_tokens = TENANT_TOKENS.declare(registry)
        self.tenant_rejections = TENANT_REJECTIONS.declare(registry)
        self.tenant_queued = TENANT_QUEUED.declare(registry)
        self.tenant_queue_seconds = TENANT_QUEUE_SECONDS.declare(registry)
        self.quota_store_up = QUOTA_STORE_UP.declare(registry)
        # Every routed request counts its decision: the labelled children are looked up once
        # per (model, reason), not per request (labels() validates and locks each time).
        self._decision_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._slot_children: dict[tuple[str, str], Any] = {}

    def decided(self, model: str, reason: str, prefix_tokens: int, slot: str | None = None) -> None:
        """One routing decision, and the prompt tokens its replica already held; for a request
        naming an adapter (`model` is the adapter's name), the adapter's slot state there."""
        children = self._decision_children.get((model, reason))
        if children is None:
            children = self._decision_children[(model, reason)] = (
                self.decisions.labels(model, reason),
                self.prefix_match_tokens.labels(model),
            )
        children[0].inc()
        children[1].observe(prefix_tokens)
        if slot is not None:
            counter = self._slot_children.get((model, slot))
            if counter is None:
                counter = self._slot_children[(model, slot)] = self.adapter_routes.labels(
                    model, slot
                )
            counter.inc()
