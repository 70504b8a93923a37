"""One round of LoRA adapter sync on one InferenceService: the API calls and engine calls around
the pure plan and report of adapters.py.

kopf's `adapters` timer calls AdapterSync.run for every InferenceService with adapters (in the
spec, or still in its status). A timer of its own, rather than reconcile or the autoscaler's
tick: reconcile is synchronous and holds the object's lock, and a load can take as long as a
download (the lock would stall every other handler of the object); the autoscaler ticks only
with spec.autoscaling. kopf never overlaps an object's timer runs, so an object's rounds are
sequential; the status is written through Reconciler.apply_adapter_status, under the lock.

A round: re-read the object, list its Ready pods, ask each what it has loaded (/v1/models),
unload and load what differs (replicas concurrently, actions of one replica in order), ask again
the replicas where a load did not succeed, write status, post a Warning Event per new failure.
The Deployment is never touched: a bad adapter leaves the base model serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvpilot.contract.kube import ENGINE_PORT
from kvpilot.operator.adapter_client import AdapterClient, base_url
from kvpilot.operator.adapters import (
    Action,
    AdapterReport,
    Load,
    Result,
    WantedAdapter,
    build_report,
    plan,
    previous_entries,
    wanted_adapters,
)
from kvpilot.operator.autoscaling.pods import count_pods
from kvpilot.operator.builders import Owner, selector_labels, served_model_name
from kvpilot.operator.conditions import ADAPTERS_READY, Condition
from kvpilot.operator.kube import KubeApi, KubeError
from kvpilot.operator.reconcile import PostEvent, Reconciler
from kvpilot.operator.spec import (
    ApiKeySecret,
    InvalidSpecError,
    check_adapter_names,
    parse_spec,
)

logger = logging.getLogger(__name__)

API_KEY_UNREADABLE = "ApiKeyUnreadable"

Listing = Mapping[str, str] | None


class AdapterSync:
    """One per operator: the API, the pooled engine client, shared by all objects."""

    def __init__(
        self,
        api: KubeApi,
        reconciler: Reconciler,
        client: AdapterClient,
        post_event: PostEvent,
        *,
        engine_port: int = ENGINE_PORT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api = api
        self._reconciler = reconciler
        self._client = client
        self._post_event = post_event
        self._engine_port = engine_port
        self._clock = clock

    async def run(self, body: Mapping[str, Any]) -> AdapterReport | None:
        """One round for the InferenceService `body` names; None when skipped (gone, invalid
        spec: reconcile reports that). API trouble is logged and left to the next round."""
        metadata = body["metadata"]
        namespace, name = metadata["namespace"], metadata["name"]
        try:
            return await self._round(namespace, name, metadata.get("uid"))
        except KubeError as error:
            logger.warning(
                "adapter sync of %s/%s failed, the next round retries: %s", namespace, name, error
            )
            return None

    async def _round(self, namespace: str, name: str, uid: str | None) -> AdapterReport | None:
        body = await asyncio.to_thread(self._api.get_inferenceservice, namespace, name)
        if body is None:
            return None
        metadata = body["metadata"]
        if (uid is not None and metadata.get("uid") != uid) or metadata.get("deletionTimestamp"):
            return None
        try:
            spec = parse_spec(body.get("spec"))
            owner = Owner(name=name, namespace=namespace, uid=metadata["uid"])
            check_adapter_names(spec, served_model_name(owner, spec))
        except InvalidSpecError:
            return None
        wanted = wanted_adapters(spec)
        now = self._clock()
        pods = await asyncio.to_thread(self._api.list_pods, namespace, selector_labels(name))
        # Any age: a pod not Ready yet is simply not synced yet.
        ready = count_pods(pods, now, startup_grace_s=float("inf")).ready
        urls = {pod: None if ip is None else base_url(ip, self._engine_port) for pod, ip in ready}
        previous = previous_entries(body.get("status"))
        key_problem = None
        api_key = None
        if spec.engine.api_key_secret is not None and ready:
            api_key, key_problem = await self._api_key(namespace, spec.engine.api_key_secret)
        if key_problem is not None:
            # Nothing can be asked of the engines: each replica's state is unknown, and why.
            report = build_report(
                wanted, list(urls), {}, dict.fromkeys(urls, key_problem), [], previous, now
            )
            if wanted:
                condition = Condition(ADAPTERS_READY, False, API_KEY_UNREADABLE, key_problem)
                report = replace(report, condition=condition)
            results: list[Result] = []
        else:
            rounds = await asyncio.gather(
                *(
                    self._sync_replica(pod, url, api_key, wanted, previous, now)
                    for pod, url in urls.items()
                )
            )
            listings = {pod: listing for pod, (listing, _, _) in zip(urls, rounds, strict=True)}
            errors = {pod: err for pod, (_, err, _) in zip(urls, rounds, strict=True) if err}
            results = [result for _, _, replica_results in rounds for result in replica_results]
            report = build_report(wanted, list(urls), listings, errors, results, previous, now)
        before = await asyncio.to_thread(
            self._reconciler.apply_adapter_status,
            namespace,
            name,
            metadata["uid"],
            report.adapters or None,
            report.summary,
            report.condition,
        )
        if before is None:
            return None
        for adapter, pod, message in report.new_failures:
            self._post_event(
                body,
                "Warning",
                "AdapterFailed",
                f"the engine in {pod} refused adapter {adapter}: {message}",
            )
        _post_condition_event(self._post_event, body, before, report)
        for result in results:
            logger.info(
                "adapters of %s/%s: %s %s on %s -> %s %s",
                namespace,
                name,
                type(result.action).__name__.lower(),
                result.action.name,
                result.action.pod,
                result.status,
                result.message,
            )
        return report

    async def _api_key(self, namespace: str, secret: ApiKeySecret) -> tuple[str | None, str | None]:
        """(the engines' API key, None) or (None, why it cannot be read)."""
        where = f"key {secret.key!r} of Secret {namespace}/{secret.name}"
        try:
            key = await asyncio.to_thread(
                self._api.read_secret_key, namespace, secret.name, secret.key
            )
        except KubeError as error:
            if error.is_retryable:
                raise
            return None, (
                f"the operator cannot read the engines' API key ({where}): {error}; install "
                "the chart with rbac.readApiKeySecrets=true to load adapters into engines "
                "that require a key"
            )
        if not key:
            return None, f"the engines' API key ({where}) is missing or empty"
        return key, None

    async def _sync_replica(
        self,
        pod: str,
        url: str | None,
        api_key: str | None,
        wanted: Sequence[WantedAdapter],
        previous: Mapping[tuple[str, str], Mapping[str, Any]],
        now: float,
    ) -> tuple[Listing, str | None, list[Result]]:
        """(its listing after the actions, why there is none, the actions' results)."""
        if url is None:
            return None, "the pod is Ready but has no IP", []
        listing = await self._client.list_loaded(url, api_key)
        if isinstance(listing, str):
            return None, listing, []
        results = []
        for action in plan(wanted, {pod: listing}, previous, now):
            results.append(await self._client.run(url, api_key, action))
        if any(isinstance(r.action, Load) and not r.is_done for r in results):
            # A load that got no 200 may still have happened (an earlier call's, finishing):
            # the engine's own listing says.
            again = await self._client.list_loaded(url, api_key)
            if isinstance(again, str):
                return None, again, results
            return again, None, results
        return _after(listing, results), None, results


def _after(listing: Mapping[str, str], results: Sequence[Result]) -> dict[str, str]:
    """The listing with the actions that succeeded applied."""
    loaded = dict(listing)
    for result in results:
        action: Action = result.action
        if not result.is_done:
            continue
        if isinstance(action, Load):
            loaded[action.name] = action.path
        else:
            loaded.pop(action.name, None)
    return loaded


def _post_condition_event(
    post_event: PostEvent,
    body: Mapping[str, Any],
    before: Mapping[str, Any],
    report: AdapterReport,
) -> None:
    """An Event when AdaptersReady changes reason: Normal once every adapter is loaded, Warning
    when the key is unreadable (each refused adapter has an Event of its own)."""
    condition = report.condition
    if condition is None:
        return
    conditions = (before.get("status") or {}).get("conditions") or []
    previous = next((c for c in conditions if c.get("type") == condition.type), None)
    if previous is not None and previous.get("reason") == condition.reason:
        return
    if condition.status:
        post_event(body, "Normal", condition.reason, condition.message)
    elif condition.reason == API_KEY_UNREADABLE:
        post_event(body, "Warning", condition.reason, condition.message)
