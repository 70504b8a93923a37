"""kmock's KubernetesEmulator with the API-server behaviour our operator and kopf rely on.

The stock emulator stores objects as plain dicts (see /work/shared/notes/kopf-with-kmock.md).
This subclass adds what a real API server does and the tests need: uid, resourceVersion,
generation and creationTimestamp; generateName; 422 for a failed JSON-patch test; status
subresource isolation; no watch event (nor resourceVersion bump) for a patch that changes
nothing; Deployments and Services stored in the server's form (defaults filled in, `omitempty`
zero values dropped, quantities canonical: server_defaults.py); and dry-run patches
(`?dryRun=All`), answered with the object the patch would make, which is not stored. And faults
(`inject_fault`): chosen requests answered with an error, at once or after hanging, and not
applied — kmock's own reactions answer a write only after the emulator has stored it. Everything
else (no garbage collection, selectors ignored, apply as a merge patch) stays the emulator's
limit, which the operator's code never relies on.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import itertools
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import jsonpatch
import kmock

from .autoscaling_helpers import merge_patch
from .server_defaults import stored

# (resource, kind, namespaced, subresources): every resource the operator or kopf touches must be
# declared before kopf starts, as kopf discovers them through /apis. kopf waits for namespaces
# and CRDs to be discoverable even when it never lists them (scanning is disabled).
RESOURCES = (
    ("kvpilot.dev/v1alpha1/inferenceservices", "InferenceService", True, {"status", "scale"}),
    ("kvpilot.dev/v1alpha1/tenants", "Tenant", True, {"status"}),
    ("apps/v1/deployments", "Deployment", True, {"status", "scale"}),
    ("v1/services", "Service", True, {"status"}),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, {"status"}),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, set()),
    ("v1/pods", "Pod", True, {"status"}),
    ("v1/secrets", "Secret", True, set()),
    ("v1/events", "Event", True, set()),
    ("v1/namespaces", "Namespace", False, {"status"}),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, set()),
)
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


@dataclasses.dataclass
class Fault:
    """The next `count` requests that `pick` matches are answered `status` after `delay` seconds
    (a hang, when longer than the client waits), and after `hold` is set when one is given; they
    are not applied. `hits`: when each came."""

    pick: Callable[[kmock.Request], bool]
    status: int
    count: int
    delay: float = 0.0
    hold: asyncio.Event | None = None
    hits: list[float] = dataclasses.field(default_factory=list)


class KubeEmulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1000)
        self._last_version = 999
        self._faults: list[Fault] = []
        for resource, kind, namespaced, subresources in RESOURCES:
            info = self.resources[resource]
            info.kind, info.namespaced, info.verbs = kind, namespaced, VERBS
            info.subresources = subresources

    def _next_version(self) -> str:
        self._last_version = next(self._versions)
        return str(self._last_version)

    def inject_fault(
        self,
        pick: Callable[[kmock.Request], bool],
        status: int,
        count: int,
        delay: float = 0.0,
        hold: asyncio.Event | None = None,
    ) -> Fault:
        """From now on, the next `count` requests `pick` matches fail (see Fault)."""
        fault = Fault(pick, status, count, delay, hold)
        self._faults.append(fault)
        return fault

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        for fault in self._faults:
            if len(fault.hits) < fault.count and fault.pick(request):
                fault.hits.append(time.monotonic())
                await asyncio.sleep(fault.delay)
                if fault.hold is not None:
                    await fault.hold.wait()
                message = f"injected {fault.status}"
                body = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "message": message, "code": fault.status}  # fmt: skip
                return aiohttp.web.json_response(body, status=fault.status)
        if request.resource is not None and request.params.get("dryRun"):
            return aiohttp.web.json_response(self._dry_run(request))
        if request.resource is not None:
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                self._prepare_create(request)
            elif request.action == kmock.action.UPDATE and request.data is not None:
                unchanged = self._prepare_patch(request)
                if unchanged is not None:
                    return aiohttp.web.json_response(unchanged)
            elif request.action == kmock.action.DELETE:
                self._prepare_delete(request)
        return await super()._handle(request)

    async def _serve_list(self, request: kmock.Request) -> Any:
        # A real list carries the resourceVersion a watch continues from.
        listing = await super()._serve_list(request)
        listing["metadata"]["resourceVersion"] = str(self._last_version)
        return listing

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        # A watch from a resourceVersion sends only what changed after it; the stock emulator
        # replays every object as ADDED, and kopf then handles a stale copy twice.
        since = request.params.get("resourceVersion", "")
        async for event in super()._serve_watch(request):
            if isinstance(event, dict) and since.isdigit():
                version = str(event.get("object", {}).get("metadata", {}).get("resourceVersion"))
                if version.isdigit() and int(version) <= int(since):
                    continue
            yield event

    def _prepare_delete(self, request: kmock.Request) -> None:
        """Marking a finalized object for deletion is a change too: a new resourceVersion."""
        key = (request.resource, request.namespace, request.name)
        if key in self._objects and not self._objects[key].deleted:
            metadata = self._objects[key].get("metadata", {})
            if metadata.get("finalizers") and not metadata.get("deletionTimestamp"):
                self._objects[key].patch({"metadata": {"resourceVersion": self._next_version()}})

    def _has_status(self, request: kmock.Request) -> bool:
        for resource, _, _, subresources in RESOURCES:
            if kmock.resource(resource) == request.resource:
                return "status" in subresources
        return False

    def _kind(self, request: kmock.Request) -> str | None:
        for resource, kind, _, _ in RESOURCES:
            if kmock.resource(resource) == request.resource:
                return kind
        return None

    def _dry_run(self, request: kmock.Request) -> dict[str, Any]:
        """A dry-run patch: the object as the patch would leave it, nothing stored or sent."""
        if request.action != kmock.action.UPDATE or request.data is None:
            raise kmock.KubernetesError(
                status=400, reason="BadRequest", message="dry-run: patches only"
            )
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        return self._patched(request, copy.deepcopy(self._objects[key].raw))

    def _patched(self, request: kmock.Request, old: dict[str, Any]) -> dict[str, Any]:
        """`old` with the request's patch applied, in the server's stored form."""
        patch = request.data
        if self._has_status(request):
            patch = _isolate(patch, to_status=request.subresource == "status")
        try:
            new = _apply_patch(copy.deepcopy(old), copy.deepcopy(patch))
        except jsonpatch.JsonPatchException as error:  # e.g. kopf's resourceVersion "test"
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(error)) from None
        return stored(self._kind(request) or "", new)

    def _prepare_create(self, request: kmock.Request) -> None:
        data = request.data
        metadata = data.setdefault("metadata", {})
        if not metadata.get("name") and metadata.get("generateName"):
            metadata["name"] = metadata["generateName"] + secrets.token_hex(3)
        if request.namespace and not metadata.get("namespace"):
            metadata["namespace"] = request.namespace
        metadata.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_version(),
            generation=1,
            creationTimestamp=_now(),
        )
        if self._has_status(request):
            data.pop("status", None)  # status is written through /status only
        object.__setattr__(request, "data", stored(self._kind(request) or "", data))

    def _prepare_patch(self, request: kmock.Request) -> dict[str, Any] | None:
        """Adds the server's metadata changes to a patch; returns the object if it is a no-op.

        The patch stays a patch (applied later, under the emulator's lock, to whatever the object
        is by then), so concurrent writers of different fields never undo each other.
        """
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return None  # the emulator answers 404
        old = copy.deepcopy(self._objects[key].raw)
        new = self._patched(request, old)
        if new == old:
            return old  # a real API server neither bumps resourceVersion nor emits an event
        server_side = {"resourceVersion": self._next_version()}
        if new.get("spec") != old.get("spec"):
            server_side["generation"] = (old.get("metadata", {}).get("generation") or 1) + 1
        patch = request.data
        if isinstance(patch, dict):
            # The merge patch from old to new: the stored form, and no more than the patch
            # changed (status isolation included).
            new["metadata"] = {**(new.get("metadata") or {}), **server_side}
            patch = _merge_diff(old, new)
        else:
            if self._has_status(request):
                patch = _isolate(patch, to_status=request.subresource == "status")
            patch = [
                *patch,
                *(
                    {"op": "add", "path": f"/metadata/{k}", "value": v}
                    for k, v in server_side.items()
                ),
            ]
        object.__setattr__(request, "data", patch)
        return None


def _isolate(patch: Any, *, to_status: bool) -> Any:
    """Only status through /status; anything but status through the object itself."""
    if isinstance(patch, dict):
        if to_status:
            return {"status": patch["status"]} if "status" in patch else {}
        return {key: value for key, value in patch.items() if key != "status"}
    keep = [op for op in patch if str(op.get("path", "")).startswith("/status") == to_status]
    return keep


def _merge_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns `old` into `new` (null removes a key; lists are whole)."""
    diff: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old:
            diff[key] = value
        elif isinstance(value, dict) and isinstance(old[key], dict):
            nested = _merge_diff(old[key], value)
            if nested:
                diff[key] = nested
        elif value != old[key]:
            diff[key] = value
    return diff


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _apply_patch(old: dict[str, Any], patch: dict[str, Any] | list[Any]) -> dict[str, Any]:
    """A merge patch (a mapping) or a JSON patch (a list of operations), as the API server."""
    if isinstance(patch, list):
        return jsonpatch.apply_patch(old, patch)
    merge_patch(old, patch)
    return old
