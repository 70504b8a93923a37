"""Names only the operator uses: the CRD's other names, its field managers, the engine pod's
volumes, user and timings, the operator's own ports and defaults (what the router and the engine
share with it is kvpilot.contract.kube)."""

from __future__ import annotations

from kvpilot.contract.kube import GROUP, PLURAL

# The custom resource's other names.
SINGULAR = "inferenceservice"
SHORT_NAMES = ("kis",)
CATEGORIES = ("kvpilot",)
CRD_NAME = f"{PLURAL}.{GROUP}"

# Our own annotations on children (the prefix is the API group, as Kubernetes conventions ask).
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"

# The read timeout of each API call the operator's own code makes (kube.py): a hung API server
# fails the call, which is retried with backoff, instead of holding a reconcile forever.
DEFAULT_API_TIMEOUT_SECONDS = 30.0

# Server-side apply field manager: the name under which our fields show in managedFields.
FIELD_MANAGER = "kvpilot-operator"
AUTOSCALER_FIELD_MANAGER = "kvpilot-autoscaler"

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
