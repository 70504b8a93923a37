"""The autoscaler at work on one InferenceService: the API calls around one autoscale_tick.

kopf's autoscale timer calls Autoscaler.run for every InferenceService with spec.autoscaling.
A run parses the spec once (spec.autoscaling.policy: the one settings object the whole tick
reads), re-reads the object (kopf's copy may predate the status the last tick wrote, and the
windows live in that status), skips it until its intervalSeconds has passed, reads the
Deployment and lists its pods, reads what the kvpilot routers hold for it (RouterLoad, shared by
all objects), scrapes and decides (autoscale_tick), then writes the replicas
and status through Reconciler.apply_scale (under the lock reconcile holds: the two never
interleave; refused when the spec changed since the parse) and posts the tick's Events. The
user's spec is never written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvpilot.contract.kube import ENGINE_PORT
from kvpilot.operator.autoscaling.metrics import OperatorMetrics
from kvpilot.operator.autoscaling.policy import AutoscalingPolicy
from kvpilot.operator.autoscaling.routers import RouterLoad
from kvpilot.operator.autoscaling.scrape import Scrape
from kvpilot.operator.autoscaling.tick import TickResult, autoscale_tick, is_tick_due
from kvpilot.operator.builders import selector_labels
from kvpilot.operator.kube import KubeApi, KubeError
from kvpilot.operator.reconcile import PostEvent, Reconciler, is_controlled_by
from kvpilot.operator.spec import InvalidSpecError, parse_spec

logger = logging.getLogger(__name__)


class Autoscaler:
    """One per operator: the API, the pooled scraper and the metrics, shared by all objects.

    kopf runs one timer per object and never overlaps its runs, so an object's ticks are
    sequential; different objects tick concurrently.
    """

    def __init__(
        self,
        api: KubeApi,
        reconciler: Reconciler,
        scrape: Scrape,
        post_event: PostEvent,
        *,
        metrics: OperatorMetrics | None = None,
        engine_metrics_port: int = ENGINE_PORT,
        routers: RouterLoad | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api = api
        self._reconciler = reconciler
        self._scrape = scrape
        self._post_event = post_event
        self._metrics = metrics
        self._engine_metrics_port = engine_metrics_port
        self._routers = routers
        self._clock = clock

    async def run(self, body: Mapping[str, Any]) -> TickResult | None:
        """One tick of the InferenceService `body` names; None when skipped or refused.

        API trouble is logged and left to the next tick: a tick is cheap and level-based, and a
        retry with backoff would only delay the next fresh look.
        """
        policy = _policy_of(body)
        # kopf's copy first: a cheap skip, with no API call, while the interval has not passed.
        if policy is None or not is_tick_due(policy, body.get("status"), self._clock()):
            return None
        metadata = body["metadata"]
        namespace, name = metadata["namespace"], metadata["name"]
        try:
            return await self._tick(
                namespace, name, metadata.get("uid"), (metadata.get("generation"), policy)
            )
        except KubeError as error:
            logger.warning(
                "autoscaler tick of %s/%s failed, the next one retries: %s", namespace, name, error
            )
            return None

    async def _tick(
        self,
        namespace: str,
        name: str,
        uid: str | None,
        parsed: tuple[int | None, AutoscalingPolicy],
    ) -> TickResult | None:
        body = await asyncio.to_thread(self._api.get_inferenceservice, namespace, name)
        if body is None:
            return None
        metadata = body["metadata"]
        if (uid is not None and metadata.get("uid") != uid) or metadata.get("deletionTimestamp"):
            return None
        generation, policy = parsed
        if metadata.get("generation") != generation:  # the spec changed since kopf's copy
            generation, fresh = metadata.get("generation"), _policy_of(body)
            if fresh is None:
                return None
            policy = fresh
        now = self._clock()
        if not is_tick_due(policy, body.get("status"), now):
            return None
        deployment = await asyncio.to_thread(self._api.get, "Deployment", namespace, name)
        if deployment is None or not is_controlled_by(deployment, metadata["uid"]):
            return None  # reconcile creates it first (or reports whose it is)
        current = (deployment.get("spec") or {}).get("replicas")
        pods = await asyncio.to_thread(self._api.list_pods, namespace, selector_labels(name))
        router = None
        if self._routers is not None:
            router = (await self._routers.snapshot()).for_service(namespace, name)
        result = await autoscale_tick(
            body,
            policy,
            pods,
            1 if current is None else current,  # the API server's default
            now=now,
            scrape=self._scrape,
            metrics=self._metrics,
            metrics_port=self._engine_metrics_port,
            router=router,
        )
        applied = await asyncio.to_thread(
            self._reconciler.apply_scale,
            namespace,
            name,
            result.replicas,
            result.status_patch,
            seen=(generation, policy),
        )
        if applied is None:
            # The spec changed since the read (autoscaling turned off, new bounds): nothing was
            # written, so nothing is announced; the next tick decides on the new spec.
            return None
        for event in result.events:
            self._post_event(body, event.type, event.reason, event.message)
        if result.replicas is not None and result.decision is not None:
            decision = result.decision
            logger.info(
                "autoscaled %s/%s %d -> %d (%s): %s",
                namespace,
                name,
                decision.previous_replicas,
                applied,
                decision.reason,
                decision.message,
            )
        return result


def _policy_of(body: Mapping[str, Any]) -> AutoscalingPolicy | None:
    """The InferenceService's autoscaling settings; None without autoscaling or with an invalid
    spec (reconcile reports that as InvalidSpec, with an Event)."""
    try:
        autoscaling = parse_spec(body.get("spec")).autoscaling
    except InvalidSpecError:
        return None
    return None if autoscaling is None else autoscaling.policy
