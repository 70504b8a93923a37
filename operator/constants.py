"""Names every part of the operator agrees on: the API, labels, ports, paths in the engine pod."""

from __future__ import annotations

# The custom resource.
GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("kis",)
CATEGORIES = ("kvpilot",)
CRD_NAME = f"{PLURAL}.{GROUP}"

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

# Our own annotations on children (the prefix is the API group, as Kubernetes conventions ask).
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
# Written by kvpilot router on an InferenceService at zero replicas whose requests it holds (the
# value: when, and which router); the operator scales it to one replica at once. Not under
# "kvpilot.dev/": kopf keeps its own state under that prefix and ignores changes to it.
ANNOTATION_WAKE = f"router.{GROUP}/wake-requested-at"

# The read timeout of each API call the operator's own code makes (kube.py): a hung API server
# fails the call, which is retried with backoff, instead of holding a reconcile forever.
DEFAULT_API_TIMEOUT_SECONDS = 30.0

# Server-side apply field manager: the name under which our fields show in managedFields.
FIELD_MANAGER = "kvpilot-operator"
AUTOSCALER_FIELD_MANAGER = "kvpilot-autoscaler"

# The engine container's contract: `kvpilot serve` on this port, /ready, /health and /metrics.
ENGINE_PORT = 8000
ENGINE_PORT_NAME = "http"
ENGINE_CONTAINER = "engine"
READY_PATH = "/ready"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"

# The model-cache volume: hf:// downloads land here, pvc:// claims are mounted here.
MODEL_CACHE_VOLUME = "model-cache"
SHM_VOLUME = "dshm"  # a memory-backed /dev/shm for tensor-parallel ranks
MODEL_CACHE_MOUNT = "/models"
MODEL_FETCH_CONTAINER = "model-fetch"
# A writable emptyDir at /tmp (HOME too): the containers' root filesystem is read-only.
TMP_VOLUME = "tmp"
TMP_MOUNT = "/tmp"
NVIDIA_GPU = "nvidia.com/gpu"

# Our image runs as this non-root user (see the Dockerfile); pods run with it under PSS restricted.
ENGINE_UID = 10001

# Seconds the preStop hook waits so endpoints drop the pod before the engine sees SIGTERM, and the
# margin after the engine's drain before the kubelet kills it.
PRESTOP_SLEEP_SECONDS = 5
TERMINATION_MARGIN_SECONDS = 10

# The operator's own ports: kopf's liveness endpoint, and its Prometheus /metrics.
DEFAULT_LIVENESS_PORT = 8080
DEFAULT_METRICS_PORT = 8081

DEFAULT_ENGINE_IMAGE = "ghcr.io/kvpilot/kvpilot:0.1.0"
DEFAULT_ANNOTATION_PREFIX = GROUP

# Well-known node labels the default topology spread uses.
TOPOLOGY_HOSTNAME = "kubernetes.io/hostname"
TOPOLOGY_ZONE = "topology.kubernetes.io/zone"
# Pods that may always reach the engines when spec.networkPolicy is set: the operator (its
# autoscaler scrapes /metrics) and the router carry it.
NETWORK_PEER_LABELS = {LABEL_PART_OF: PART_OF}
