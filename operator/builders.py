"""Pure builders of the children of an InferenceService: the engine Deployment and its Service.

No client and no I/O: (owner, spec, settings) in, a manifest dict out. reconcile.py applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpilot.contract.kube import (
    API_VERSION,
    ENGINE_APP_NAME,
    ENGINE_COMPONENT,
    ENGINE_CONTAINER,
    ENGINE_PORT,
    ENGINE_PORT_NAME,
    HEALTH_PATH,
    KIND,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    MANAGED_BY,
    METRICS_PATH,
    PART_OF,
    READY_PATH,
)
from kvpilot.contract.lora import RUNTIME_LORA_FLAG
from kvpilot.operator.constants import (
    ENGINE_UID,
    MODEL_CACHE_MOUNT,
    MODEL_CACHE_VOLUME,
    MODEL_FETCH_CONTAINER,
    NVIDIA_GPU,
    PRESTOP_SLEEP_SECONDS,
    SHM_VOLUME,
    TERMINATION_MARGIN_SECONDS,
    TMP_MOUNT,
    TMP_VOLUME,
    TOPOLOGY_HOSTNAME,
    TOPOLOGY_ZONE,
)
from kvpilot.operator.modeluri import HfModel, ModelSource, PvcModel
from kvpilot.operator.spec import API_KEY_ENV, InferenceServiceSpec

DEFAULT_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")
STARTUP_PERIOD_SECONDS = 10
# The model download's own footprint: it streams files to disk, so little memory is needed.
MODEL_FETCH_RESOURCES = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
    "limits": {"memory": "4Gi"},
}


@dataclass(frozen=True)
class Owner:
    """The InferenceService the children belong to."""

    name: str
    namespace: str
    uid: str


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select an InferenceService's pods; never changed after create."""
    return {LABEL_NAME: ENGINE_APP_NAME, LABEL_INSTANCE: name}


def child_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        LABEL_COMPONENT: ENGINE_COMPONENT,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: PART_OF,
    }


def label_selector(name: str) -> str:
    """status.selector, in the string form the scale subresource (and HPA) expects."""
    return ",".join(f"{key}={value}" for key, value in selector_labels(name).items())


def service_url(owner: Owner) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{ENGINE_PORT}/v1"


def served_model_name(owner: Owner, spec: InferenceServiceSpec) -> str:
    return spec.model.served_name or owner.name


def owner_reference(owner: Owner) -> dict[str, Any]:
    # controller=True: `kubectl get deploy` shows who owns it, and a second controller cannot
    # adopt it; blockOwnerDeletion keeps a foreground delete of the owner waiting for the child.
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(owner: Owner) -> dict[str, Any]:
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": child_labels(owner.name),
        "ownerReferences": [owner_reference(owner)],
    }


def child_metadata(owner: Owner) -> dict[str, Any]:
    """The metadata every child carries: its name, our labels, the controller reference."""
    return _metadata(owner)


def build_engine_args(spec: InferenceServiceSpec, served_name: str) -> list[str]:
    """`kvpilot serve` arguments; builtin:// models take no --model at all."""
    args = ["serve", "--host", "0.0.0.0", "--port", str(ENGINE_PORT)]
    model_dir = spec.model.source.local_dir
    if model_dir is not None:
        args += ["--model", model_dir]
    args += ["--served-model-name", served_name]
    engine = spec.engine
    options = (
        ("--block-size", engine.block_size),
        ("--max-model-len", engine.max_model_len),
        ("--max-num-seqs", engine.max_num_seqs),
        ("--max-num-batched-tokens", engine.max_num_batched_tokens),
        ("--dtype", engine.dtype),
        ("--kv-cache-dtype", engine.kv_cache_dtype),
        ("--gpu-memory-utilization", engine.gpu_memory_utilization),
        ("--kv-cache-memory-bytes", spec.kv_cache_bytes),
        ("--structured-outputs-backend", engine.structured_outputs_backend),
        ("--tool-call-parser", engine.tool_call_parser),
        ("--chat-template", engine.chat_template),
    )
    for flag, value in options:
        if value is not None:
            args += [flag, str(value)]
    if not engine.enable_prefix_caching:
        args.append("--no-enable-prefix-caching")
    if spec.effective_tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(spec.effective_tensor_parallel_size)]
    args += ["--shutdown-timeout", str(spec.drain_seconds)]
    args += ["--scheduling-policy", engine.scheduling_policy]
    return args + build_lora_args(spec) + list(engine.extra_args)


def build_lora_args(spec: InferenceServiceSpec) -> list[str]:
    """LoRA on, runtime loading on, and the limits - never the adapters themselves: the
    operator loads those through the engine's API, so adding or removing one leaves the pod
    template (and the ReplicaSet) as it is."""
    if not spec.is_lora_enabled:
        return []
    limits = spec.lora_limits
    return [
        "--enable-lora",
        RUNTIME_LORA_FLAG,
        "--max-loras",
        str(limits.max_loras),
        "--max-lora-rank",
        str(limits.max_lora_rank),
        "--max-cpu-loras",
        str(limits.effective_max_cpu_loras),
    ]


def engine_cache_dir(spec: InferenceServiceSpec) -> str:
    """Where the engine writes what it derives (converted GGUF weights, compiled CPU kernels):
    the model-cache volume, shared by the pods when it is a claim; the /tmp volume when the
    model volume is a read-only pvc:// claim. The root filesystem is read-only."""
    if isinstance(spec.model.source, PvcModel):
        return f"{TMP_MOUNT}/kvpilot-cache"
    return f"{MODEL_CACHE_MOUNT}/.kvpilot-cache"


def build_engine_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    # Weights are local by the time the engine starts (downloaded, mounted or bundled): offline
    # mode keeps tokenizer loading from reaching out to the Hub. HOME on /tmp catches any library
    # that writes under ~ (the root filesystem is read-only). User env overrides by name.
    ours: list[dict[str, Any]] = [
        {"name": "HOME", "value": TMP_MOUNT},
        {"name": "KVPILOT_CACHE_DIR", "value": engine_cache_dir(spec)},
        {"name": "TRITON_CACHE_DIR", "value": f"{engine_cache_dir(spec)}/triton"},
    ]
    if spec.is_lora_enabled:
        # The engine fetches hf:// adapters itself when it loads them, into the model cache
        # (the /tmp volume where the model's claim is mounted read-only): online, with the
        # model's token for private repos. Set by LoRA being on, never by which adapters.
        ours.append({"name": "HF_HOME", "value": f"{engine_cache_dir(spec)}/hf-home"})
    else:
        ours.insert(0, {"name": "HF_HUB_OFFLINE", "value": "1"})
    user = _user_env(spec)
    names = {var["name"] for var in user}
    env = [var for var in ours if var["name"] not in names] + user
    token = spec.model.token_secret
    if spec.is_lora_enabled and token is not None and "HF_TOKEN" not in names:
        ref = {"secretKeyRef": {"name": token.name, "key": token.key}}
        env.append({"name": "HF_TOKEN", "valueFrom": ref})
    secret = spec.engine.api_key_secret
    if secret is not None:
        # From the Secret at container start: never in the args, the Deployment or an Event.
        ref = {"secretKeyRef": {"name": secret.name, "key": secret.key}}
        env.append({"name": API_KEY_ENV, "valueFrom": ref})
    return env


def _user_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    return [var.model_dump(by_alias=True, exclude_none=True) for var in spec.engine.env]


def build_model_fetch_container(
    spec: InferenceServiceSpec, source: HfModel, image: str
) -> dict[str, Any]:
    """The init container that downloads an hf:// model into the model-cache volume and converts
    a GGUF there, into the cache the engine reads (engine_cache_dir), once for every pod."""
    args = ["--repo", source.repo, "--dest", source.local_dir]
    args += ["--cache-dir", engine_cache_dir(spec)]
    if source.revision is not None:
        args += ["--revision", source.revision]
    for pattern in spec.model.allow_patterns or DEFAULT_ALLOW_PATTERNS:
        args += ["--allow-pattern", pattern]
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{MODEL_CACHE_MOUNT}/.hf-home"}]
    token = spec.model.token_secret
    if token is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}},
            }
        )
    # The user's env comes along so HF_ENDPOINT, proxies and the like reach the download too.
    names = {var["name"] for var in env}
    env += [var for var in _user_env(spec) if var["name"] not in names]
    container: dict[str, Any] = {
        "name": MODEL_FETCH_CONTAINER,
        "image": image,
        "command": ["python", "-m", "kvpilot.operator.modelfetch"],
        "args": args,
        "env": env,
        "resources": model_fetch_resources(spec),
        "volumeMounts": [
            {"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT},
            _tmp_volume_mount(),
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security_context(),
    }
    if spec.engine.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    return container


def model_fetch_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The init container's resources: converting a GGUF holds the dequantized weights, as the
    engine would have, so it may use the engine's memory limit (an init container's resources
    do not add to the pod's: the larger of the two counts)."""
    memory = build_engine_resources(spec).get("limits", {}).get("memory")
    if memory is None:
        return MODEL_FETCH_RESOURCES
    return {**MODEL_FETCH_RESOURCES, "limits": {"memory": memory}}


def build_model_cache_volume(spec: InferenceServiceSpec, source: ModelSource) -> dict[str, Any]:
    if isinstance(source, PvcModel):
        claim = {"claimName": source.claim, "readOnly": True}
        return {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": claim}
    cache = spec.model.cache
    if cache is not None and cache.claim_name is not None:
        return {
            "name": MODEL_CACHE_VOLUME,
            "persistentVolumeClaim": {"claimName": cache.claim_name},
        }
    empty_dir: dict[str, Any] = {}
    if cache is not None and cache.size_limit is not None:
        empty_dir["sizeLimit"] = str(cache.size_limit)
    return {"name": MODEL_CACHE_VOLUME, "emptyDir": empty_dir}


def build_engine_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    # Quantities as strings, the form the API returns them in (and the client's models accept).
    resources: dict[str, Any] = {}
    if spec.resources is not None:
        for kind in ("limits", "requests"):
            given = getattr(spec.resources, kind)
            if given:
                resources[kind] = {name: str(value) for name, value in given.items()}
    if spec.gpus:
        # Extended resources need only a limit; the request defaults to it.
        resources.setdefault("limits", {})[NVIDIA_GPU] = str(spec.gpus)
    return resources


def build_tolerations(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    # GPU node pools are commonly tainted nvidia.com/gpu:NoSchedule; tolerating the taint is
    # implied by asking for a GPU (what the ExtendedResourceToleration admission plugin does).
    if spec.gpus and not any(t.get("key") == NVIDIA_GPU for t in tolerations):
        tolerations.append({"key": NVIDIA_GPU, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def build_probes(spec: InferenceServiceSpec) -> dict[str, Any]:
    def http_get(path: str) -> dict[str, Any]:
        return {"path": path, "port": ENGINE_PORT_NAME}

    startup_failures = math.ceil(spec.engine.startup_timeout_seconds / STARTUP_PERIOD_SECONDS)
    return {
        # Liveness and readiness start only once the startup probe passed: a model loading for
        # twenty minutes is not restarted, a hung engine afterwards is.
        "startupProbe": {
            "httpGet": http_get(READY_PATH),
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": startup_failures,
        },
        # /ready turns 503 as soon as the engine drains, so the pod leaves the Service fast.
        "readinessProbe": {
            "httpGet": http_get(READY_PATH),
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": http_get(HEALTH_PATH),
            "periodSeconds": 15,
            "timeoutSeconds": 5,
            "failureThreshold": 4,
        },
    }


def _container_security_context() -> dict[str, Any]:
    # PSS "restricted", plus a read-only root: every write goes to a mounted volume.
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _tmp_volume_mount() -> dict[str, Any]:
    return {"name": TMP_VOLUME, "mountPath": TMP_MOUNT}


def build_engine_container(
    spec: InferenceServiceSpec, image: str, served_name: str
) -> dict[str, Any]:
    is_pvc_model = isinstance(spec.model.source, PvcModel)
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        "command": ["kvpilot"],
        "args": build_engine_args(spec, served_name),
        "env": build_engine_env(spec),
        "ports": [{"name": ENGINE_PORT_NAME, "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": build_engine_resources(spec),
        "volumeMounts": [
            {
                "name": MODEL_CACHE_VOLUME,
                "mountPath": MODEL_CACHE_MOUNT,
                "readOnly": is_pvc_model,
            },
            _tmp_volume_mount(),
            *([{"name": SHM_VOLUME, "mountPath": "/dev/shm"}] if needs_shm(spec) else []),
        ],
        **build_probes(spec),
        # The endpoints controller needs a moment to drop the pod from the Service; only then
        # does the engine get SIGTERM and drain for drainSeconds.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        # A crash's last log lines become the pod's message, which status shows as Degraded.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security_context(),
    }
    if spec.engine.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    return container


def needs_shm(spec: InferenceServiceSpec) -> bool:
    """Tensor-parallel ranks (processes of one pod) want a memory-backed /dev/shm."""
    return spec.effective_tensor_parallel_size > 1


def termination_grace_seconds(spec: InferenceServiceSpec) -> int:
    """The drain rule: the kubelet waits preStop (endpoints drop the pod) + the engine's drain
    (--shutdown-timeout = drainSeconds) + a margin for uvicorn and the engine core to stop, so
    SIGKILL never lands on a drain still within its time."""
    return PRESTOP_SLEEP_SECONDS + spec.drain_seconds + TERMINATION_MARGIN_SECONDS


def build_topology_spread(owner: Owner, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """spec.topologySpreadConstraints, or by default: replicas spread across nodes and zones as
    far as the scheduler can (ScheduleAnyway: never a reason to leave a pod Pending). Counted per
    ReplicaSet (matchLabelKeys), so a rollout's new pods spread among themselves."""
    if spec.topology_spread_constraints is not None:
        return [dict(constraint) for constraint in spec.topology_spread_constraints]
    return [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector_labels(owner.name)},
            "matchLabelKeys": ["pod-template-hash"],
        }
        for key in (TOPOLOGY_HOSTNAME, TOPOLOGY_ZONE)
    ]


def build_pod_template(owner: Owner, spec: InferenceServiceSpec, image: str) -> dict[str, Any]:
    source = spec.model.source
    served_name = served_model_name(owner, spec)
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": METRICS_PATH,
        "kubectl.kubernetes.io/default-container": ENGINE_CONTAINER,
        **spec.pod_annotations,
    }
    pod_spec: dict[str, Any] = {
        "containers": [build_engine_container(spec, image, served_name)],
        "volumes": [
            build_model_cache_volume(spec, source),
            {"name": TMP_VOLUME, "emptyDir": {}},
            # NCCL moves data between the ranks' processes through shared memory; a container's
            # default /dev/shm is 64 MiB.
            *([{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}] if needs_shm(spec) else []),
        ],
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        # Hundreds of Services in a namespace would otherwise become env vars of every engine.
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_UID,
            "runAsGroup": ENGINE_UID,
            "fsGroup": ENGINE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if isinstance(source, HfModel):
        pod_spec["initContainers"] = [build_model_fetch_container(spec, source, image)]
    if spec.service_account_name is not None:
        pod_spec["serviceAccountName"] = spec.service_account_name
    else:
        pod_spec["automountServiceAccountToken"] = False  # the engine never calls the API
    tolerations = build_tolerations(spec)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.affinity is not None:
        pod_spec["affinity"] = spec.affinity
    if spec.priority_class_name is not None:
        pod_spec["priorityClassName"] = spec.priority_class_name
    if spec.runtime_class_name is not None:
        pod_spec["runtimeClassName"] = spec.runtime_class_name
    spread = build_topology_spread(owner, spec)
    if spread:
        pod_spec["topologySpreadConstraints"] = spread
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in spec.image_pull_secrets]
    return {
        "metadata": {
            "labels": {**spec.pod_labels, **child_labels(owner.name)},
            "annotations": annotations,
        },
        "spec": pod_spec,
    }


def build_deployment(
    owner: Owner, spec: InferenceServiceSpec, *, default_image: str, replicas: int
) -> dict[str, Any]:
    """The engine Deployment. `replicas` comes from reconcile (fixed size or the autoscaler's);
    spec.engine.image wins over the operator's `default_image`."""
    image = spec.engine.image or default_image
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec.rollout.max_surge,
                    "maxUnavailable": spec.rollout.max_unavailable,
                },
            },
            # Loading a big model legitimately takes as long as the startup probe allows: only
            # past that is a rollout stuck (ProgressDeadlineExceeded, shown as Degraded).
            "progressDeadlineSeconds": spec.engine.startup_timeout_seconds + 300,
            "revisionHistoryLimit": 5,
            "template": build_pod_template(owner, spec, image),
        },
    }


def build_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name),
            "ports": [
                {
                    "name": ENGINE_PORT_NAME,
                    "port": ENGINE_PORT,
                    "targetPort": ENGINE_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }
