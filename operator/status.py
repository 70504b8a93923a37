"""InferenceService status: its schema (for the CRD) and the pure function that computes it from
what the cluster shows (the Deployment, the pods) and the previous status.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from kvpilot.operator.conditions import (
    DEGRADED,
    PROGRESSING,
    READY,
    Condition,
    set_condition,
    with_kstatus,
)
from kvpilot.operator.diagnose import PodProblem, most_pressing
from kvpilot.operator.kubetypes import FreeForm, KubeModel

# The status keys reconcile owns. The autoscaler owns `autoscaling` (and `desiredReplicas`
# while autoscaling is on), the adapter sync `adapters`, `adapterSummary` and the AdaptersReady
# condition; status writes are merge patches of only one's own keys.
OWNED_KEYS = (
    "observedGeneration",
    "conditions",
    "replicas",
    "readyReplicas",
    "updatedReplicas",
    "desiredReplicas",
    "selector",
    "url",
    "endpoint",
    "model",
    "tensorParallelSize",
)


class StatusCondition(KubeModel):
    """One aspect of the service's state, as Kubernetes conditions are."""

    type: Literal[
        "Ready",
        "Progressing",
        "Degraded",
        "Reconciling",
        "Stalled",
        "MemorySufficient",
        "AdaptersReady",
    ] = Field(
        description="Ready: serving requests. Progressing: a rollout or scale is under way. "
        "Degraded: something needs attention. Reconciling and Stalled: kstatus' names of "
        "Progressing and Degraded (for Flux, kpt, kubectl wait). MemorySufficient (only when it "
        "was ever False): resources.requests.memory covers what the engine needs. "
        "AdaptersReady (only with spec.adapters): every adapter is loaded in every Ready "
        "replica; False says which the engine refused and why (the base model serves on)."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason, e.g. Serving, CrashLoopBackOff.")
    message: str = Field(description="Human-readable details.")
    last_transition_time: str = Field(
        json_schema_extra={"format": "date-time"},
        description="When status last changed (not reason or message).",
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation this condition was computed for."
    )


class AdapterReplicaStatus(KubeModel):
    """One adapter in one Ready replica."""

    pod: str = Field(description="The replica's pod.")
    state: Literal["Loaded", "Loading", "Failed", "Unloading", "Unknown"] = Field(
        description="Loaded; Loading (asked, not listed yet); Failed (the engine refused it: "
        "see message; tried again after a while or when its uri changes); Unloading (removed "
        "from the spec, still in use: retried); Unknown (the replica did not answer)."
    )
    message: str | None = Field(default=None, description="Why, when not Loaded.")
    last_attempt_time: str | None = Field(
        default=None,
        json_schema_extra={"format": "date-time"},
        description="When the engine last refused it (Failed only).",
    )


class AdapterStatus(KubeModel):
    """One adapter across the replicas."""

    name: str = Field(description="The adapter's name (the `model` requests ask for).")
    uri: str | None = Field(default=None, description="Its uri (absent once removed).")
    state: Literal["Loaded", "Loading", "Failed", "Unloading", "Unknown", "Pending"] = Field(
        description="The worst of its replicas' states; Pending while no replica is Ready."
    )
    loaded_replicas: int = Field(description="Replicas that hold it.")
    replicas: list[AdapterReplicaStatus] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["pod"]},
        description="Its state in each Ready replica.",
    )


class InferenceServiceStatus(KubeModel):
    """Observed state, written by the operator."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation the status reflects."
    )
    conditions: list[StatusCondition] = Field(
        default_factory=list,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
        description="Ready, Progressing, Degraded, and kstatus' Reconciling and Stalled.",
    )
    replicas: int | None = Field(default=None, description="Engine pods that exist.")
    ready_replicas: int | None = Field(default=None, description="Engine pods ready to serve.")
    updated_replicas: int | None = Field(
        default=None, description="Engine pods running the current spec."
    )
    desired_replicas: int | None = Field(
        default=None,
        description="Replicas wanted now: spec.replicas, or the autoscaler's decision.",
    )
    selector: str | None = Field(
        default=None, description="Label selector of the engine pods (for the scale subresource)."
    )
    url: str | None = Field(
        default=None, description="In-cluster OpenAI base URL of this service's own Service."
    )
    endpoint: str | None = Field(
        default=None,
        description="The OpenAI base URL users call: kvpilot router's when one serves this "
        "namespace (one URL for every model; `model` picks the service), else url.",
    )
    model: str | None = Field(default=None, description="Model name to use in requests.")
    tensor_parallel_size: int | None = Field(
        default=None, description="Ranks (GPUs) each engine pod splits the model over."
    )
    autoscaling: FreeForm | None = Field(
        default=None, description="The autoscaler's state and recent decisions."
    )
    adapters: list[AdapterStatus] | None = Field(
        default=None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Each LoRA adapter's state in each Ready replica (spec.adapters, and "
        "removed ones until every replica has unloaded them).",
    )
    adapter_summary: str | None = Field(
        default=None,
        description="Adapter loads in place out of those wanted (adapters x Ready replicas), "
        "e.g. 6/6.",
    )


@dataclass(frozen=True)
class Observed:
    """What reconcile saw of the cluster, after applying its children."""

    generation: int | None
    deployment: dict[str, Any] | None
    pods: list[dict[str, Any]]
    desired_replicas: int | None
    selector: str
    url: str
    model: str
    tensor_parallel_size: int = 1
    endpoint: str | None = None  # None: url


def build_invalid_status(
    previous: dict[str, Any], generation: int | None, message: str, now: datetime.datetime
) -> dict[str, Any]:
    """The spec cannot be reconciled: the children keep running the last good spec."""
    return _with_conditions(
        previous,
        generation,
        now,
        Condition(READY, False, "InvalidSpec", message),
        Condition(PROGRESSING, False, "InvalidSpec", "fix the spec to continue"),
        Condition(DEGRADED, True, "InvalidSpec", message),
    )


def build_blocked_status(
    previous: dict[str, Any],
    generation: int | None,
    reason: str,
    message: str,
    now: datetime.datetime,
) -> dict[str, Any]:
    """Something outside the spec blocks reconcile (e.g. a foreign object under our name)."""
    return _with_conditions(
        previous,
        generation,
        now,
        Condition(READY, False, reason, message),
        Condition(PROGRESSING, False, reason, message),
        Condition(DEGRADED, True, reason, message),
    )


def _with_conditions(
    previous: dict[str, Any], generation: int | None, now: datetime.datetime, *new: Condition
) -> dict[str, Any]:
    conditions = list(previous.get("conditions") or [])
    for condition in with_kstatus(*new):
        conditions = set_condition(conditions, condition, generation=generation, now=now)
    status = {key: previous[key] for key in OWNED_KEYS if key in previous}
    return {**status, "observedGeneration": generation, "conditions": conditions}


def build_status(
    previous: dict[str, Any], observed: Observed, now: datetime.datetime
) -> dict[str, Any]:
    """The status reconcile owns (OWNED_KEYS), computed from the Deployment and the pods."""
    deployment = observed.deployment or {}
    dep_status = deployment.get("status") or {}
    replicas = dep_status.get("replicas") or 0
    ready = dep_status.get("readyReplicas") or 0
    updated = dep_status.get("updatedReplicas") or 0
    available = dep_status.get("availableReplicas") or 0
    desired = observed.desired_replicas
    if desired is None:
        desired = (deployment.get("spec") or {}).get("replicas", 0)
    dep_conditions = {c.get("type"): c for c in dep_status.get("conditions") or []}
    progressing = dep_conditions.get("Progressing") or {}
    is_stuck = progressing.get("reason") == "ProgressDeadlineExceeded"
    replica_failure = dep_conditions.get("ReplicaFailure") or {}
    is_current = (dep_status.get("observedGeneration") or 0) >= (
        (deployment.get("metadata") or {}).get("generation") or 0
    )
    is_rolled_out = (
        bool(deployment)
        and is_current
        and updated >= desired
        and replicas == desired
        and available >= desired
    )
    problem = most_pressing(observed.pods)

    degraded = _degraded(problem, is_stuck, progressing, replica_failure)
    if is_stuck:
        rollout = Condition(
            PROGRESSING,
            False,
            "ProgressDeadlineExceeded",
            progressing.get("message") or "the rollout made no progress",
        )
    elif is_rolled_out:
        rollout = Condition(
            PROGRESSING, False, "RolloutComplete", f"{desired} replica(s) up to date"
        )
    else:
        rollout = Condition(
            PROGRESSING,
            True,
            "RollingOut",
            f"{updated}/{desired} replica(s) updated, {available} available",
        )
    ready_condition = _ready(desired, ready, degraded)

    conditions = list(previous.get("conditions") or [])
    for condition in with_kstatus(ready_condition, rollout, degraded):
        conditions = set_condition(conditions, condition, generation=observed.generation, now=now)
    return {
        "observedGeneration": observed.generation,
        "conditions": conditions,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "desiredReplicas": desired,
        "selector": observed.selector,
        "url": observed.url,
        "endpoint": observed.endpoint or observed.url,
        "model": observed.model,
        "tensorParallelSize": observed.tensor_parallel_size,
    }


def _degraded(
    problem: PodProblem | None,
    is_stuck: bool,
    progressing: dict[str, Any],
    replica_failure: dict[str, Any],
) -> Condition:
    if problem is not None:
        return Condition(DEGRADED, True, problem.reason, problem.message)
    if is_stuck:
        message = progressing.get("message") or "the rollout made no progress"
        return Condition(DEGRADED, True, "ProgressDeadlineExceeded", message)
    if replica_failure.get("status") == "True":
        message = replica_failure.get("message") or "pods cannot be created"
        return Condition(DEGRADED, True, "ReplicaFailure", message)
    return Condition(DEGRADED, False, "AsExpected", "no problem seen in the engine pods")


def _ready(desired: int, ready: int, degraded: Condition) -> Condition:
    if desired == 0:
        return Condition(READY, False, "ScaledToZero", "replicas is 0: nothing serves requests")
    if ready > 0:
        return Condition(READY, True, "Serving", f"{ready}/{desired} replica(s) ready")
    if degraded.status:
        return Condition(READY, False, degraded.reason, degraded.message)
    return Condition(
        READY,
        False,
        "WaitingForReplicas",
        f"0/{desired} replica(s) ready (pulling the image and loading the model can take minutes)",
    )


def owned_status(status: dict[str, Any]) -> dict[str, Any]:
    """The part of a status reconcile owns, to compare before writing."""
    return {key: status[key] for key in OWNED_KEYS if key in status}
