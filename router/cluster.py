"""What the router needs from Kubernetes objects, as pure functions: an InferenceService's served
model name, its LoRA adapters and scale-to-zero setting, and an engine pod's address and
readiness."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.contract.kube import (
    ENGINE_APP_NAME,
    ENGINE_CONTAINER,
    ENGINE_PORT,
    ENGINE_PORT_NAME,
    GROUP,
    LABEL_INSTANCE,
    LABEL_NAME,
)
from kvpilot.contract.lora import name_problem

ENGINE_POD_SELECTOR = f"{LABEL_NAME}={ENGINE_APP_NAME}"
# Per InferenceService: how long the router holds its requests while it has no ready replica
# (a big model loads for minutes, a small one for seconds).
HOLD_TIMEOUT_ANNOTATION = f"{GROUP}/hold-timeout-seconds"
# spec.engine.apiKeySecret's key when it names none (kvpilot.operator.spec.ApiKeySecret's
# default; a test holds them equal: importing the operator's spec costs the router seconds).
DEFAULT_API_KEY_SECRET_KEY = "api-key"


@dataclass(frozen=True)
class SecretKeyRef:
    """One key of one Secret: where an InferenceService's engines read their API key."""

    namespace: str
    name: str
    key: str


@dataclass(frozen=True)
class Adapter:
    name: str  # the `model` id (contract.lora NAME_PATTERN)
    uri: str


@dataclass(frozen=True)
class ServiceInfo:
    namespace: str
    name: str
    model: str  # what clients put in `model`
    may_scale_to_zero: bool
    created: str  # creationTimestamp: the older service keeps a contested model name
    hold_timeout_s: float | None = None  # from HOLD_TIMEOUT_ANNOTATION; None: the router's
    # The weights (spec.model.uri): the tokenizer the router loaded stays valid while it is the
    # same, also at zero replicas; another one is loaded afresh.
    model_uri: str = ""
    # spec.adapters: each a `model` id of its own, served by this service's replicas.
    adapters: tuple[Adapter, ...] = ()
    # spec.sharedPrefixes: texts whose KV every tenant shares (kvpilot.router.shared_prefix).
    shared_prefixes: tuple[str, ...] = ()
    # spec.engine.apiKeySecret: the key its engines require on every path but the probes.
    api_key_secret: SecretKeyRef | None = None


@dataclass(frozen=True)
class Endpoint:
    namespace: str
    pod: str
    service: str  # the InferenceService it belongs to
    url: str
    is_ready: bool  # Ready and not being deleted: may take new requests


def service_info(obj: dict[str, Any]) -> ServiceInfo:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    model = (spec.get("model") or {}).get("servedName") or meta["name"]
    autoscaling = spec.get("autoscaling") or {}
    may_scale_to_zero = autoscaling.get("minReplicas") == 0 or spec.get("replicas") == 0
    return ServiceInfo(
        meta.get("namespace", ""),
        meta["name"],
        model,
        may_scale_to_zero,
        meta.get("creationTimestamp") or "",
        hold_timeout((meta.get("annotations") or {}).get(HOLD_TIMEOUT_ANNOTATION)),
        str((spec.get("model") or {}).get("uri") or ""),
        adapters(spec.get("adapters"), model),
        shared_prefixes(spec.get("sharedPrefixes")),
        api_key_secret(meta.get("namespace", ""), (spec.get("engine") or {}).get("apiKeySecret")),
    )


def api_key_secret(namespace: str, ref: Any) -> SecretKeyRef | None:
    """spec.engine.apiKeySecret as a reference into the service's namespace; None when unset or
    without a name."""
    if not isinstance(ref, dict) or not isinstance(ref.get("name"), str) or not ref["name"]:
        return None
    key = ref.get("key")
    return SecretKeyRef(
        namespace, ref["name"], key if isinstance(key, str) and key else DEFAULT_API_KEY_SECRET_KEY
    )


def shared_prefixes(items: Any) -> tuple[str, ...]:
    """spec.sharedPrefixes: its non-empty strings (the router does not trust the CRD did it)."""
    return tuple(t for t in items if isinstance(t, str) and t) if isinstance(items, list) else ()


def adapters(items: Any, model: str) -> tuple[Adapter, ...]:
    """spec.adapters as the router may route them: entries with a valid name, other than the
    served model's, each name once (the first). The CRD refuses the others; the router does not
    trust that an object it reads went through it."""
    found: dict[str, Adapter] = {}
    for item in items if isinstance(items, list) else []:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or name_problem(name) or name == model or name in found:
            continue
        found[name] = Adapter(name, str(item.get("uri") or ""))
    return tuple(found.values())


def hold_timeout(value: str | None) -> float | None:
    """A positive number of seconds, or None (unset or unreadable: the router's default)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 < seconds < float("inf") else None


def endpoint(pod: dict[str, Any]) -> Endpoint | None:
    """None for a pod that is not an engine pod of an InferenceService, or has no IP yet."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(LABEL_NAME) != ENGINE_APP_NAME or not labels.get(LABEL_INSTANCE):
        return None
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip:
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    host = f"[{ip}]" if ":" in ip else ip
    return Endpoint(
        meta.get("namespace", ""),
        meta["name"],
        labels[LABEL_INSTANCE],
        f"http://{host}:{engine_port(pod)}",
        # A pod being deleted is still Ready while its preStop hook runs: the router stops
        # sending to it at once, before its engine starts draining.
        ready and not meta.get("deletionTimestamp"),
    )


def engine_port(pod: dict[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") != ENGINE_CONTAINER:
            continue
        for port in container.get("ports") or []:
            if port.get("name") == ENGINE_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return ENGINE_PORT
