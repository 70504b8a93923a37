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

from kvpilot.operator.autoscaling.metrics import OperatorMetrics
from kvpilot.operator.builders import (
    Owner,
    build_deployment,
    build_service,
    label_selector,
    selector_labels,
    served_model_name,
    service_url,
)
from kvpilot.operator.conditions import DEGRADED, changed_conditions
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.constants import KIND
from kvpilot.operator.drift import (
    config_hash,
    config_hash_of,
    has_drifted,
    is_subset,
    stored_fields,
    with_config_hash,
)
from kvpilot.operator.kube import KubeApi, KubeError
from kvpilot.operator.spec import InferenceServiceSpec, InvalidSpecError, parse_spec, validate_name
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
    bounds = spec.autoscaling
    current = None if live is None else (live.get("spec") or {}).get("replicas")
    if current is None:
        return bounds.min_replicas
    return min(max(current, bounds.min_replicas), bounds.max_replicas)


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
        self._forget_metrics(namespace, name)
        for kind in CHILD_KINDS:
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
        only_from: int | None = None,
    ) -> int | None:
        """The autoscaler's hook: set the Deployment's replicas (and write the autoscaler's own
        status keys), under this object's lock so that no reconcile interleaves.

        Only for an InferenceService with a valid spec.autoscaling and a Deployment it controls;
        the count is clamped into [minReplicas, maxReplicas] (replicas None keeps the live count,
        clamped). Returns the replicas applied, or None when refused (nothing written). Reconcile
        keeps whatever count this sets (see replicas_for). The status patch gets
        desiredReplicas = the count applied, which is what reconcile reports too: the two never
        rewrite each other's value. With only_from, nothing changes unless the live count is that.
        """
        with self._lock(namespace, name):
            body = self._api.get_inferenceservice(namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return None
            try:
                spec = parse_spec(body.get("spec"))
            except InvalidSpecError:
                return None
            live = self._api.get("Deployment", namespace, name)
            if (
                spec.autoscaling is None
                or live is None
                or not is_controlled_by(live, body["metadata"]["uid"])
            ):
                return None
            bounds = spec.autoscaling
            current = (live.get("spec") or {}).get("replicas")
            if only_from is not None and current != only_from:
                return None  # it moved meanwhile (a wake at zero finds it already up)
            wanted = current if replicas is None else replicas
            if wanted is None:
                wanted = bounds.min_replicas
            bounded = min(max(wanted, bounds.min_replicas), bounds.max_replicas)
            if current != bounded:
                self._api.scale_deployment(namespace, name, bounded)
            if status_patch:
                self._api.patch_inferenceservice_status(
                    namespace, name, {**status_patch, "desiredReplicas": bounded}
                )
            return bounded

    def _reconcile(self, body: Mapping[str, Any]) -> Outcome:
        metadata = body["metadata"]
        namespace, name = metadata["namespace"], metadata["name"]
        generation = metadata.get("generation")
        previous = dict(body.get("status") or {})
        try:
            validate_name(name)
            spec = parse_spec(body.get("spec"))
        except InvalidSpecError as error:
            message = str(error)
            status = build_invalid_status(previous, generation, message, self._clock())
            self._write_status(body, previous, status)
            return Outcome(invalid=message)

        owner = Owner(name=name, namespace=namespace, uid=metadata["uid"])
        live_deployment = self._api.get("Deployment", namespace, name)
        live_service = self._api.get("Service", namespace, name)
        for kind, live in (("Deployment", live_deployment), ("Service", live_service)):
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
            endpoint=self._config.router_url,
        )
        status = build_status(previous, observed, self._clock())
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
        current = {key: value for key, value in status.items() if value is not None}
        stale = [key for key, value in status.items() if value is None and key in previous]
        if owned_status(previous) == owned_status(current) and not stale:
            return
        metadata = body["metadata"]
        self._api.patch_inferenceservice_status(metadata["namespace"], metadata["name"], status)
        # One Event per reason (Ready and Degraded often share one): Warning if any says so.
        changed: dict[str, tuple[bool, str]] = {}
        for condition in changed_conditions(
            previous.get("conditions") or [], status.get("conditions") or []
        ):
            reason = condition["reason"]
            is_warning = (condition["type"] == DEGRADED and condition["status"] == "True") or (
                reason == "InvalidSpec"
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
