"""The metric families the operator's autoscaler scales on: an engine's queue, running batch and
KV-cache usage, and a router's held and in-flight requests. The engine and the router declare
them from these rows; the autoscaler reads the names these rows give, so a renamed family cannot
leave it scraping a name nobody serves.

An engine's shared family is shown as `kvpilot:<name>` and as vLLM's `vllm:<name>`, so the
autoscaler scales any vLLM-compatible server too.
"""

from __future__ import annotations

from prometheus_client import Gauge

from kvpilot.contract.prometheus import Family

KVPILOT = "kvpilot"
VLLM = "vllm"

NUM_REQUESTS_WAITING = Family(
    Gauge,
    "num_requests_waiting",
    "Requests waiting to be scheduled (queued in the engine or being handed to it).",
)
NUM_REQUESTS_RUNNING = Family(
    Gauge, "num_requests_running", "Requests in the engine's running batch (prefill or decode)."
)
KV_CACHE_USAGE = Family(
    Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks held by running requests (0 to 1)."
)
# vLLM's pre-0.9 name of KV_CACHE_USAGE, shown under vllm: only (KEDA and HPA recipes read it).
GPU_CACHE_USAGE = Family(
    Gauge, "gpu_cache_usage_perc", f"Deprecated alias of {VLLM}:kv_cache_usage_perc."
)

# The router's, labelled with the InferenceService the autoscaler adds them to.
ROUTER_HELD_REQUESTS = Family(
    Gauge,
    "kvpilot_router_held_requests",
    "Requests held for a model with no routable replica (scale from zero)",
    ("model", "namespace", "inferenceservice"),
)
ROUTER_IN_FLIGHT_REQUESTS = Family(
    Gauge,
    "kvpilot_router_in_flight_requests",
    "Requests this router has sent to replicas and not yet seen finish",
    ("model", "namespace", "inferenceservice"),
)


def engine_names(family: Family) -> tuple[str, str]:
    """The names an engine shows a shared family under, kvpilot's first."""
    return f"{KVPILOT}:{family.name}", f"{VLLM}:{family.name}"
