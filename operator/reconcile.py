"""The one level-based reconcile of an InferenceService: read, build desired, apply on drift,
write status, report state changes as Events. Every kopf handler ends up here.

Idempotent: running it twice in a row changes nothing the second time (no API write, no Event).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.contract.kube import KIND
from kvpilot.operator.autoscaling.metrics import OperatorMetrics
from kvpilot.operator.autoscaling.policy import AutoscalingPolicy
from kvpilot.operator.builders import (
    Owner,
    build_deployment,
    build_service,
    label_selector,
    selector_labels,
    served_model_name,
    service_url,
)
from kvpilot.operator.conditions import (
    ADAPTERS_READY,
    DEGRADED,
    MEMORY_SUFFICIENT,
    Condition,
    changed_conditions,
    find_condition,
    set_condition,
)
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.drift import (
    config_hash,
    config_hash_of,
    has_drifted,
    is_subset,
    stored_fields,
    with_config_hash,
)
from kvpilot.operator.kube import KubeApi, KubeError
from kvpilot.operator.memory import limit_problem, request_shortfall
from kvpilot.operator.policies import build_network_policy, build_pod_disruption_budget
from kvpilot.operator.spec import (
    InferenceServiceSpec,
    InvalidSpecError,
    check_adapter_names,
    parse_spec,
    validate_name,
)
from kvpilot.operator.status import (
    Observed,
    build_blocked_status,
    build_invalid_status,
    build_status,
    owned_status,
)

logger = logging.getLogger(__name__)

# (object body, event type, reason, message): kopf.event in the operator, a list in tests.
PostEvent = Callable[[Mapping[str, Any], str, str, str], None]
# A child: (kind, namespace, name).
ChildKey = tuple[str, str, str]
CHILD_KINDS = ("Deployment", "Service")
# Children only some specs ask for; a None from the builder deletes one made before.
OPTIONAL_CHILDREN = (
    ("PodDisruptionBudget", build_pod_disruption_budget),
    ("NetworkPolicy", build_network_policy),
)


@dataclass(frozen=True)
class Outcome:
    """What one reconcile found; `invalid` is the spec error a change handler reports."""

    invalid: str | None = None
    blocked: str | None = None


def replicas_for(spec: InferenceServiceSpec, live: Mapping[str, Any] | None) -> int:
    """The Deployment's replicas reconcile applies — the autoscaler's hook.

    Without spec.autoscaling: spec.replicas. With it, the autoscaler owns the count: reconcile
    starts a new Deployment at minReplicas and afterwards only clamps the live count into
    [minReplicas, maxReplicas] (when the user narrows the bounds); it never undoes a scale.
    """
    if spec.autoscaling is None:
        return spec.effective_replicas
    policy = spec.autoscaling.policy
    current = None if live is None else (live.get("spec") or {}).get("replicas")
    return policy.min_replicas if current is None else policy.clamp(current)


def check_memory_limit(spec: InferenceServiceSpec) -> None:
    """InvalidSpec for a memory limit the engine would refuse to start under (known models)."""
    problem = limit_problem(spec)
    if problem is not None:
        raise InvalidSpecError(f"spec.resources: {problem}")


def memory_condition(spec: InferenceServiceSpec, previous: Mapping[str, Any]) -> Condition | None:
    """MemorySufficient=False while the memory request is below the engine's need; set back to
    True once fixed, and absent for an object that never had the problem."""
    shortfall = request_shortfall(spec)
    if shortfall is not None:
        return Condition(MEMORY_SUFFICIENT, False, "MemoryRequestBelowNeed", shortfall)
    if find_condition(previous.get("conditions") or [], MEMORY_SUFFICIENT) is None:
        return None
    return Condition(MEMORY_SUFFICIENT, True, "MemoryRequestCoversNeed", "requests cover the need")


def is_controlled_by(live: Mapping[str, Any], uid: str) -> bool:
    references = (live.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in references)


class Reconciler:
    """Holds the API and a lock per object: kopf runs an object's timer and change handlers
    (and the child watchers) concurrently, and two reconciles of one object must not interleave.

    It also remembers, per child, the stored form of the last desired manifest it applied or
    dry-ran (drift.stored_fields): a resync of an unchanged child then costs no API call. Lost on
    a restart, it is asked of the server again by one dry-run apply per child.
    """

    def __init__(
        self,
        api: KubeApi,
        config: OperatorConfig,
        post_event: PostEvent,
        clock: Callable[[], datetime.datetime] | None = None,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self._api = api
        self._config = config
        self._post_event = post_event
        self._clock = clock or (lambda: datetime.datetime.now(datetime.timezone.utc))
        self._metrics = metrics
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # child -> (config_hash of the desired manifest, its stored form)
        self._stored_forms: dict[ChildKey, tuple[str, dict[str, Any]]] = {}

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(self, body: Mapping[str, Any]) -> Outcome:
        """Reconciles the InferenceService `body` identifies (by namespace, name and uid)."""
        metadata = body["metadata"]
        return self.reconcile_named(metadata["namespace"], metadata["name"], metadata.get("uid"))

    def reconcile_owner_of(self, child: Mapping[str, Any]) -> Outcome | None:
        """A child changed (edited, scaled, deleted): reconcile the InferenceService owning it."""
        metadata = child.get("metadata") or {}
        for ref in metadata.get("ownerReferences") or []:
            if ref.get("kind") == KIND and ref.get("controller"):
                return self.reconcile_named(metadata["namespace"], ref["name"], ref.get("uid"))
        return None

    def reconcile_named(self, namespace: str, name: str, uid: str | None = None) -> Outcome:
        try:
            return self._reconcile_named(namespace, name, uid)
        except Exception:
            if self._metrics is not None:
                self._metrics.reconcile_errors.labels(namespace, name).inc()
            raise

    def _reconcile_named(self, namespace: str, name: str, uid: str | None) -> Outcome:
        with self._lock(namespace, name), self._timed():
            # Always from the API, never the caller's copy: kopf hands timers and handlers the
            # body they were triggered with, and a reconcile queued behind another on the lock
            # must see the status that one wrote.
            body = self._api.get_inferenceservice(namespace, name)
            if body is None:
                self._forget(namespace, name)
                return Outcome()
            metadata = body["metadata"]
            if uid is not None and metadata.get("uid") != uid:
                return Outcome()  # a namesake: its own events reconcile it
            if metadata.get("deletionTimestamp"):
                # Going: the garbage collector removes the children.
                self._forget(namespace, name)
                return Outcome()
            return self._reconcile(body)

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        if self._metrics is None:
            yield
            return
        with self._metrics.reconcile_duration.time():
            yield

    def _forget(self, namespace: str, name: str) -> None:
        """Drops what is kept in memory for an InferenceService that is gone or going."""
        if self._metrics is not None:
            self._metrics.forget_resource(namespace, name)
        for kind in (*CHILD_KINDS, *(kind for kind, _ in OPTIONAL_CHILDREN)):
            self._stored_forms.pop((kind, namespace, name), None)

    def _forget_metrics(self, namespace: str, name: str) -> None:
        """Drops the autoscaler's series of an InferenceService that is gone or stopped scaling."""
        if self._metrics is not None:
            self._metrics.forget(namespace, name)

    def apply_scale(
        self,
        namespace: str,
        name: str,
        replicas: int | None,
        status_patch: Mapping[str, Any] | None = None,
        *,
        seen: tuple[int | None, AutoscalingPolicy],
        only_from: int | None = None,
    ) -> int | None:
        """The autoscaler's hook: set the Deployment's replicas (and write the autoscaler's own
        status keys), under this object's lock so that no reconcile interleaves.

        `seen` is the (metadata.generation, spec.autoscaling.policy) the tick decided with:
        refused (None, nothing written) when the spec has changed since or does not autoscale,
        when the object is going away, or when it controls no Deployment. The count is clamped
        by that policy (replicas None keeps the live count, clamped). Returns the replicas
        applied. Reconcile keeps
        whatever count this sets (see replicas_for). The status patch gets desiredReplicas = the
        count applied, which is what reconcile reports too: the two never rewrite each other's
        value. With only_from, nothing changes unless the live count is that.
        """
        generation, policy = seen
        with self._lock(namespace, name):
            body = self._api.get_inferenceservice(namespace, name)
            if (
                body is None
                or body["metadata"].get("deletionTimestamp")
                or body["metadata"].get("generation") != generation
                or not (body.get("spec") or {}).get("autoscaling")
            ):
                return None
            live = self._api.get("Deployment", namespace, name)
            if live is None or not is_controlled_by(live, body["metadata"]["uid"]):
                return None
            current = (live.get("spec") or {}).get("replicas")
            if only_from is not None and current != only_from:
                return None  # it moved meanwhile (a wake at zero finds it already up)
            wanted = current if replicas is None else replicas
            bounded = policy.min_replicas if wanted is None else policy.clamp(wanted)
            if current != bounded:
                self._api.scale_deployment(namespace, name, bounded)
            if status_patch:
                self._api.patch_inferenceservice_status(
                    namespace, name, {**status_patch, "desiredReplicas": bounded}
                )
            return bounded

    def apply_adapter_status(
        self,
        namespace: str,
        name: str,
        uid: str,
        adapters: list[dict[str, Any]] | None,
        summary: str | None,
        condition: Condition | None,
    ) -> Mapping[str, Any] | None:
        """The adapter sync's hook: write status.adapters, status.adapterSummary and the
        AdaptersReady condition (None: removed), under this object's lock, into the conditions
        as they are now (a merge patch replaces the whole list: reconcile's own must survive).
        Returns the object as it was before the write; None (nothing written) when it is gone,
        going, or another object of that name."""
        with self._lock(namespace, name):
            body = self._api.get_inferenceservice(namespace, name)
            if (
                body is None
                or body["metadata"].get("uid") != uid
                or body["metadata"].get("deletionTimestamp")
            ):
                return None
            previous = body.get("status") or {}
            conditions = list(previous.get("conditions") or [])
            if condition is not None:
                conditions = set_condition(
                    conditions,
                    condition,
                    generation=body["metadata"].get("generation"),
                    now=self._clock(),
                )
            else:
                conditions = [c for c in conditions if c.get("type") != ADAPTERS_READY]
            patch = {"adapters": adapters, "adapterSummary": summary, "conditions": conditions}
            is_same = all(
                (previous.get(key) or None) == (value or None) for key, value in patch.items()
            )
            if not is_same:
                self._api.patch_inferenceservice_status(namespace, name, patch)
            return body

    def _reconcile(self, body: Mapping[str, Any]) -> Outcome:
        metadata = body["metadata"]
        namespace, name = metadata["namespace"], metadata["name"]
        generation = metadata.get("generation")
        previous = dict(body.get("status") or {})
        owner = Owner(name=name, namespace=namespace, uid=metadata["uid"])
        try:
            validate_name(name)
            spec = parse_spec(body.get("spec"))
            check_adapter_names(spec, served_model_name(owner, spec))
            check_memory_limit(spec)
        except InvalidSpecError as error:
            message = str(error)
            status = build_invalid_status(previous, generation, message, self._clock())
            self._write_status(body, previous, status)
            return Outcome(invalid=message)

        live_deployment = self._api.get("Deployment", namespace, name)
        live_service = self._api.get("Service", namespace, name)
        optional = {
            kind: (build(owner, spec), self._api.get(kind, namespace, name))
            for kind, build in OPTIONAL_CHILDREN
        }
        wanted_live = [
            *(("Deployment", live_deployment), ("Service", live_service)),
            *((kind, live) for kind, (desired, live) in optional.items() if desired is not None),
        ]
        for kind, live in wanted_live:
            if live is not None and not is_controlled_by(live, owner.uid):
                message = (
                    f"a {kind} named {name} already exists and is not controlled by this "
                    "InferenceService: delete or rename one of them"
                )
                status = build_blocked_status(
                    previous, generation, "OwnershipConflict", message, self._clock()
                )
                self._write_status(body, previous, status)
                return Outcome(blocked=message)

        replicas = replicas_for(spec, live_deployment)
        try:
            deployment = self._apply(
                body,
                with_config_hash(
                    build_deployment(
                        owner, spec, default_image=self._config.engine_image, replicas=replicas
                    )
                ),
                live_deployment,
            )
            self._apply(body, with_config_hash(build_service(owner)), live_service)
            for kind, (desired, live) in optional.items():
                self._apply_optional(body, kind, desired, live, owner.uid)
        except KubeError as error:
            if error.status not in (400, 422):
                raise
            # The API server rejected a child built from the spec (say, a malformed affinity):
            # the spec is what needs fixing, and retrying cannot help.
            message = f"the API server rejected a child built from this spec: {error}"
            status = build_invalid_status(previous, generation, message, self._clock())
            self._write_status(body, previous, status)
            return Outcome(invalid=message)

        observed = Observed(
            generation=generation,
            deployment=deployment,
            pods=self._api.list_pods(namespace, selector_labels(name)),
            desired_replicas=replicas,
            selector=label_selector(name),
            url=service_url(owner),
            model=served_model_name(owner, spec),
            tensor_parallel_size=spec.effective_tensor_parallel_size,
            endpoint=self._config.router_url,
        )
        status = build_status(previous, observed, self._clock())
        memory = memory_condition(spec, previous)
        if memory is not None:
            status["conditions"] = set_condition(
                status["conditions"], memory, generation=generation, now=self._clock()
            )
        if spec.autoscaling is None and previous.get("autoscaling") is not None:
            status["autoscaling"] = None  # a merge patch deletes the autoscaler's stale state
            self._forget_metrics(namespace, name)
        self._write_status(body, previous, status)
        return Outcome()

    def _apply(
        self, body: Mapping[str, Any], desired: dict[str, Any], live: dict[str, Any] | None
    ) -> dict[str, Any]:
        kind, name = desired["kind"], desired["metadata"]["name"]
        if live is None:
            event = ("Normal", "Created", f"created {kind} {name}")
        elif config_hash_of(live) != config_hash_of(desired):
            event = ("Normal", "Updated", f"updated {kind} {name} to the spec")
        else:
            expected = self._stored_form(desired, live)
            if expected is None:  # deleted since we read it
                event = ("Normal", "Created", f"created {kind} {name}")
            elif not has_drifted(expected, live):
                return live
            elif _only_replicas_differ(expected, live) and _is_new_replicas(body, desired):
                replicas = desired["spec"]["replicas"]
                event = ("Normal", "Scaled", f"scaled {kind} {name} to {replicas}")
            else:
                event = (
                    "Warning",
                    "DriftRepaired",
                    f"{kind} {name} was changed outside the operator; restored it",
                )
        applied = self._api.apply(desired)
        self._remember(desired, applied)
        self._post_event(body, *event)
        logger.info("applied %s %s/%s", kind, desired["metadata"]["namespace"], name)
        return applied

    def _apply_optional(
        self,
        body: Mapping[str, Any],
        kind: str,
        desired: dict[str, Any] | None,
        live: dict[str, Any] | None,
        uid: str,
    ) -> None:
        """Applies an optional child the spec asks for, or deletes ours when it no longer does
        (one of someone else's under our name is left alone)."""
        if desired is not None:
            self._apply(body, with_config_hash(desired), live)
            return
        if live is None or not is_controlled_by(live, uid):
            return
        metadata = live["metadata"]
        self._api.delete(kind, metadata["namespace"], metadata["name"])
        self._stored_forms.pop((kind, metadata["namespace"], metadata["name"]), None)
        self._post_event(body, "Normal", "Deleted", f"deleted {kind} {metadata['name']}")

    def _stored_form(self, desired: dict[str, Any], live: dict[str, Any]) -> dict[str, Any] | None:
        """`desired` as the API server stores it (see drift.stored_fields); None if the child is
        gone.

        Remembered from the last apply or dry-run of this very manifest while the live child
        still matches it. Otherwise (after a restart, a new replica count, or a live child that
        differs: a hand edit, or another manager's list item come or gone) the server itself
        says, by a dry-run apply against the live child; comparing with the manifest as sent
        would take every zero value the server omits for drift.
        """
        remembered = self._stored_forms.get(_child_key(desired))
        if (
            remembered is not None
            and remembered[0] == config_hash(desired)
            and is_subset(remembered[1], live)
        ):
            return remembered[1]
        served = self._api.dry_run_apply(desired)
        return None if served is None else self._remember(desired, served)

    def _remember(self, desired: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
        form = stored_fields(desired, served)
        self._stored_forms[_child_key(desired)] = (config_hash(desired), form)
        return form

    def _write_status(
        self, body: Mapping[str, Any], previous: dict[str, Any], status: dict[str, Any]
    ) -> None:
        """Writes status only when it changed; one Event per changed condition reason."""
        metadata = body["metadata"]
        if self._metrics is not None:  # every reconcile, written or not (a restart forgets)
            degraded = find_condition(status.get("conditions") or [], DEGRADED) or {}
            self._metrics.set_degraded(
                metadata["namespace"],
                metadata["name"],
                degraded.get("reason") if degraded.get("status") == "True" else None,
            )
        current = {key: value for key, value in status.items() if value is not None}
        stale = [key for key, value in status.items() if value is None and key in previous]
        if owned_status(previous) == owned_status(current) and not stale:
            return
        self._api.patch_inferenceservice_status(metadata["namespace"], metadata["name"], status)
        # One Event per reason (Ready and Degraded often share one): Warning if any says so.
        changed: dict[str, tuple[bool, str]] = {}
        for condition in changed_conditions(
            previous.get("conditions") or [], status.get("conditions") or []
        ):
            reason = condition["reason"]
            is_warning = (
                (condition["type"] == DEGRADED and condition["status"] == "True")
                or reason == "InvalidSpec"
                or (condition["type"] == MEMORY_SUFFICIENT and condition["status"] == "False")
            )
            message = f"{condition['type']}={condition['status']}: {condition['message']}"
            if reason not in changed or (is_warning and not changed[reason][0]):
                changed[reason] = (is_warning, message)
        for reason, (is_warning, message) in changed.items():
            self._post_event(body, "Warning" if is_warning else "Normal", reason, message)


def _child_key(manifest: Mapping[str, Any]) -> ChildKey:
    metadata = manifest["metadata"]
    return (manifest["kind"], metadata["namespace"], metadata["name"])


def _only_replicas_differ(expected: dict[str, Any], live: dict[str, Any]) -> bool:
    without = {**expected, "spec": {k: v for k, v in expected["spec"].items() if k != "replicas"}}
    return is_subset(without, live)


def _is_new_replicas(body: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether the replicas wanted differ from those reconcile (or the autoscaler) applied last,
    as status.desiredReplicas records: then the spec changed (a scale). Otherwise the live count
    was changed by hand, and restoring it is a drift repair."""
    applied_last = (body.get("status") or {}).get("desiredReplicas")
    return applied_last is None or applied_last != desired["spec"].get("replicas")
