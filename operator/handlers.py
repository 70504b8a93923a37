"""kopf wiring: thin handlers, each one line over Reconciler.reconcile or Autoscaler.run.

`build_registry(config)` returns a registry of its own (no module-level handler state), so the
CLI, tests and embedders each run exactly the handlers they built.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import kopf

from kvpilot.contract.kube import (
    ANNOTATION_WAKE,
    GROUP,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    PLURAL,
    VERSION,
)
from kvpilot.contract.tenancy import TENANT_PLURAL
from kvpilot.operator.adapter_client import AdapterClient, AdapterClientTimeouts
from kvpilot.operator.adapter_sync import AdapterSync
from kvpilot.operator.adapters import needs_sync
from kvpilot.operator.autoscaler import Autoscaler
from kvpilot.operator.autoscaling.metrics import OperatorMetrics
from kvpilot.operator.autoscaling.routers import RouterLoad
from kvpilot.operator.autoscaling.scrape import MetricsScraper
from kvpilot.operator.autoscaling.zero import wake_scope
from kvpilot.operator.config import OperatorConfig, parse_selector
from kvpilot.operator.kube import KubeApi, KubeError, connect
from kvpilot.operator.reconcile import Outcome, Reconciler
from kvpilot.operator.tenant_check import ServedIds, served_ids_of
from kvpilot.operator.tenants import TenantChecker

logger = logging.getLogger(__name__)

T = TypeVar("T")
# The index of the model ids served (kopf passes it to handlers under this name).
SERVED_IDS = "served_ids"
# Retries of a failed reconcile wait 2, 4, 8 ... seconds, at most this long.
MAX_RETRY_DELAY_SECONDS = 120.0
TIMER_EXIT_SECONDS = 5.0


def retry_delay(retry: int) -> float:
    """Exponential backoff for the `retry`-th retry of a handler (0 for the first)."""
    return min(MAX_RETRY_DELAY_SECONDS, 2.0 ** (retry + 1))


def post_kopf_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(dict(body), type=type_, reason=reason, message=message[:1024])


def configure_kopf(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """kopf's settings for our operator: our prefix for its state, no status.kopf, no scans."""
    prefix = config.annotation_prefix
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=prefix, key="last-handled-configuration"
    )
    # kopf's timers need a finalizer (to stop cleanly when the object goes); it carries our name.
    settings.persistence.finalizer = f"{prefix}/finalizer"
    settings.posting.reporting_component = MANAGED_BY
    settings.posting.reporting_instance = os.environ.get("POD_NAME", MANAGED_BY)
    # The CRD comes with the chart before the operator starts: no need to watch CRDs and
    # namespaces (and no RBAC for them).
    settings.scanning.disabled = True
    settings.execution.max_workers = config.max_workers
    # A deleted InferenceService keeps its finalizer until its resync timer has exited; kopf
    # checks on an exiting timer this often (its default, 60 s, would hold every deletion).
    settings.background.cancellation_polling = 1.0
    # When the operator stops (or an object goes), let a tick in flight finish its scrapes and
    # writes instead of orphaning it half-way (kopf's default waits for no running timer).
    settings.background.instant_exit_timeout = TIMER_EXIT_SECONDS
    # Server-side watch timeouts make kopf reconnect now and then, so a silently dead
    # connection (a load balancer dropping it) never leaves the operator deaf.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10


def is_autoscaled(spec: kopf.Spec, **_: Any) -> bool:
    """kopf filter: the autoscaler's timer runs only for InferenceServices with autoscaling."""
    return bool(spec.get("autoscaling"))


def has_adapters(spec: kopf.Spec, status: kopf.Status, **_: Any) -> bool:
    """kopf filter: the adapter timer runs for InferenceServices with adapters to sync."""
    return needs_sync(spec, status)


class _Parts:
    """What the handlers share, built at startup inside kopf's event loop."""

    reconciler: Reconciler
    tenants: TenantChecker
    autoscaler: Autoscaler
    adapter_sync: AdapterSync
    scraper: MetricsScraper | None = None
    adapter_client: AdapterClient | None = None


def build_registry(
    config: OperatorConfig,
    api: KubeApi | None = None,
    metrics: OperatorMetrics | None = None,
) -> kopf.OperatorRegistry:
    """All handlers of the operator. `api` defaults to a client connected at startup; `metrics`
    (on a registry the caller serves) records reconcile durations and the autoscaler's work."""
    registry = kopf.OperatorRegistry()
    parts = _Parts()

    def reconciler() -> Reconciler:
        return parts.reconciler

    # A registry of our own has no login handlers: use kopf's for the kubernetes client (in-cluster
    # service account, else kubeconfig), which also re-logs in when a token expires.
    kopf.on.login(id="login", registry=registry)(kopf.login_via_client)

    # Explicit ids: kopf names its progress annotations after them (`<prefix>/reconcile`).
    @kopf.on.startup(id="startup", registry=registry)
    async def operator_startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, config)
        if api is not None:
            kube = api
        else:
            client = await asyncio.to_thread(connect)
            kube = KubeApi(client, timeout_seconds=config.api_timeout_seconds)
        parts.reconciler = Reconciler(kube, config, post_kopf_event, metrics=metrics)
        parts.tenants = TenantChecker(kube, post_kopf_event)
        # The scraper's pooled HTTP client belongs to this event loop: made here, closed below.
        parts.scraper = MetricsScraper(timeout_s=config.scrape_timeout_seconds)
        routers = None
        if config.router_namespace is not None:
            namespace, selector = config.router_namespace, parse_selector(config.router_selector)
            routers = RouterLoad(
                lambda: asyncio.to_thread(kube.list_pods, namespace, selector),
                parts.scraper.fetch_text,
                # Every service ticks on the same grid: one scrape of the routers per round.
                max_age_s=config.autoscale_interval_seconds / 2,
            )
        parts.autoscaler = Autoscaler(
            kube,
            parts.reconciler,
            parts.scraper,
            post_kopf_event,
            metrics=metrics,
            engine_metrics_port=config.engine_metrics_port,
            routers=routers,
        )
        parts.adapter_client = AdapterClient(
            timeouts=AdapterClientTimeouts(load_s=config.adapter_load_timeout_seconds)
        )
        parts.adapter_sync = AdapterSync(
            kube,
            parts.reconciler,
            parts.adapter_client,
            post_kopf_event,
            engine_port=config.engine_metrics_port,
        )
        scope = ", ".join(config.namespaces) or "all namespaces"
        logger.info("kvpilot operator watching %s; engine image %s", scope, config.engine_image)

    @kopf.on.cleanup(id="cleanup", registry=registry)
    async def operator_cleanup(**_: Any) -> None:
        if parts.scraper is not None:
            await parts.scraper.aclose()
        if parts.adapter_client is not None:
            await parts.adapter_client.aclose()

    @kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    def inferenceservice_changed(body: kopf.Body, retry: int, **_: Any) -> None:
        report(run_reconcile(lambda: reconciler().reconcile(body), retry))

    @kopf.timer(
        GROUP, VERSION, PLURAL, id="resync", interval=config.resync_seconds, registry=registry
    )
    def inferenceservice_resync(body: kopf.Body, retry: int, **_: Any) -> None:
        run_reconcile(lambda: reconciler().reconcile(body), retry)

    # sharp: ticks on a fixed grid, not `interval` after the previous tick's scrapes ended.
    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        id="autoscale",
        interval=config.autoscale_interval_seconds,
        sharp=True,
        when=is_autoscaled,
        registry=registry,
    )
    async def inferenceservice_autoscale(body: kopf.Body, **_: Any) -> None:
        await parts.autoscaler.run(body)

    # Adapters are loaded into the running replicas through the engine's API (adapter_sync.py
    # says why a timer of its own); it also runs while removed adapters are still loaded.
    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        id="adapters",
        interval=config.adapter_sync_seconds,
        when=has_adapters,
        registry=registry,
    )
    async def inferenceservice_adapters(body: kopf.Body, **_: Any) -> None:
        await parts.adapter_sync.run(body)

    # A router holds requests for it at zero replicas: one replica now, not at the next tick.
    @kopf.on.field(
        GROUP, VERSION, PLURAL, id="wake", field=("metadata", "annotations", ANNOTATION_WAKE),
        registry=registry,
    )  # fmt: skip
    def inferenceservice_wake(body: kopf.Body, new: Any, **_: Any) -> None:
        scope = wake_scope(body) if new else None
        if scope is not None:
            meta = body["metadata"]
            woken = reconciler().apply_scale(
                meta["namespace"], meta["name"], 1, seen=scope, only_from=0
            )
            if woken:
                post_kopf_event(body, "Normal", "WakeFromZero", f"a router holds requests: {new}")

    # The model ids every watched InferenceService serves, for the Tenants' grants (kopf keeps
    # the index from the watch it already has: no API call per check). Async, as it is pure and
    # quick: in the event loop, not queued behind reconciles in kopf's worker threads.
    @kopf.index(GROUP, VERSION, PLURAL, id=SERVED_IDS, registry=registry)
    async def served_ids(body: kopf.Body, **_: Any) -> dict[str, ServedIds]:
        return {SERVED_IDS: served_ids_of(body)}

    def check_tenant(body: kopf.Body, index: kopf.Index[str, ServedIds]) -> None:
        served = ServedIds.union(index.get(SERVED_IDS, []))
        meta = body["metadata"]
        parts.tenants.check(meta["namespace"], meta["name"], served)

    @kopf.on.resume(GROUP, VERSION, TENANT_PLURAL, id="check", registry=registry)
    @kopf.on.create(GROUP, VERSION, TENANT_PLURAL, id="check", registry=registry)
    @kopf.on.update(GROUP, VERSION, TENANT_PLURAL, id="check", registry=registry)
    def tenant_changed(
        body: kopf.Body, retry: int, served_ids: kopf.Index[str, ServedIds], **_: Any
    ) -> None:
        run_api_step(lambda: check_tenant(body, served_ids), retry)

    # Secrets created (or filled) after their Tenant, and models deployed after it, show here.
    @kopf.timer(
        GROUP,
        VERSION,
        TENANT_PLURAL,
        id="recheck",
        interval=config.tenant_check_seconds,
        registry=registry,
    )
    def tenant_recheck(
        body: kopf.Body, retry: int, served_ids: kopf.Index[str, ServedIds], **_: Any
    ) -> None:
        run_api_step(lambda: check_tenant(body, served_ids), retry)

    child_filter = {LABEL_MANAGED_BY: MANAGED_BY}

    @kopf.on.event(
        "apps", "v1", "deployments", id="deployment", labels=child_filter, registry=registry
    )
    def deployment_event(body: kopf.Body, **_: Any) -> None:
        run_child_reconcile(lambda: reconciler().reconcile_owner_of(body))

    @kopf.on.event("", "v1", "services", id="service", labels=child_filter, registry=registry)
    def service_event(body: kopf.Body, **_: Any) -> None:
        run_child_reconcile(lambda: reconciler().reconcile_owner_of(body))

    return registry


def run_reconcile(step: Callable[[], Outcome], retry: int) -> Outcome:
    """API trouble becomes a retry with exponential backoff; anything else propagates."""
    return run_api_step(step, retry)


def run_api_step(step: Callable[[], T], retry: int) -> T:
    """API trouble becomes a retry with exponential backoff; anything else propagates."""
    try:
        return step()
    except KubeError as error:
        if not error.is_retryable:
            raise kopf.PermanentError(str(error)) from error
        raise kopf.TemporaryError(str(error), delay=retry_delay(retry)) from error


def report(outcome: Outcome) -> None:
    """A spec that cannot work is final until the user edits it: no retry storm."""
    if outcome.invalid is not None:
        raise kopf.PermanentError(f"invalid spec: {outcome.invalid}")


def run_child_reconcile(step: Callable[[], Outcome | None]) -> None:
    # A watch event has no retries: the resync timer repairs whatever this attempt could not.
    try:
        step()
    except KubeError as error:
        logger.warning("reconcile after a child change failed, the timer will retry: %s", error)
