"""Names the operator, the router and the engine's pods agree on in a cluster: the custom
resource's API, the labels on an InferenceService's children, the annotation a router wakes one
with, and the engine container's port and probe paths."""

from __future__ import annotations

# The custom resource.
GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

# Labels on every child object. The selector pair (NAME + INSTANCE) never changes after create:
# a Deployment's selector is immutable.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
ENGINE_APP_NAME = "kvpilot-engine"
ENGINE_COMPONENT = "engine"
MANAGED_BY = "kvpilot-operator"
PART_OF = "kvpilot"
# Pods that may always reach the engines when spec.networkPolicy is set: the operator (its
# autoscaler scrapes /metrics) and the router carry it.
NETWORK_PEER_LABELS = {LABEL_PART_OF: PART_OF}

# Written by kvpilot router on an InferenceService at zero replicas whose requests it holds (the
# value: when, and which router); the operator scales it to one replica at once. Not under
# "kvpilot.dev/": kopf keeps its own state under that prefix and ignores changes to it.
ANNOTATION_WAKE = f"router.{GROUP}/wake-requested-at"

# The engine container's contract: `kvpilot serve` on this port, /ready, /health and /metrics.
ENGINE_PORT = 8000
ENGINE_PORT_NAME = "http"
ENGINE_CONTAINER = "engine"
READY_PATH = "/ready"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
