"""Each tenant's use of the current quota window, written to its status (`kubectl get tenants`
shows it): requests, tokens and requests in flight, as the shared quota store counts them for
all routers (so any router may write them; each writes only what changed).

Only tenants with a quota are counted (the store keeps nothing for the others); their full
history is in the routers' per-tenant Prometheus counters."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
from typing import Any

import httpx

from kvpilot.contract.kube import GROUP, VERSION
from kvpilot.contract.tenancy import QUOTA_WINDOW_S, TENANT_PLURAL
from kvpilot.router.config import TenancyConfig
from kvpilot.router.quota import QuotaKeeper, tenant_scope_key
from kvpilot.router.tenants import TenantDirectory

log = logging.getLogger("kvpilot.router")


def usage_status(
    requests: int, tokens: int, concurrent: int, now: float, router_name: str
) -> dict[str, Any]:
    """status.usage as the Tenant CRD declares it."""

    def stamp(seconds: float) -> str:
        moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
        return moment.isoformat(timespec="seconds").replace("+00:00", "Z")

    return {
        "windowStart": stamp(now // QUOTA_WINDOW_S * QUOTA_WINDOW_S),
        "requests": requests,
        "tokens": tokens,
        "concurrent": concurrent,
        "updatedAt": stamp(now),
        "reportedBy": router_name,
    }


async def write_usage(
    kube: httpx.AsyncClient,
    directory: TenantDirectory,
    quotas: QuotaKeeper,
    config: TenancyConfig,
    router_name: str,
) -> None:
    """Every status_interval_s: each quota'd tenant's window use, patched where it changed.
    Runs until cancelled; a failed write is retried at the next tick."""
    written: dict[str, tuple[int, int, int]] = {}
    while True:
        await asyncio.sleep(config.status_interval_s)
        for tenant in list(directory.tenants.values()):
            if not tenant.quota.is_limited:
                continue
            try:
                usage = await quotas.usage(tenant_scope_key(tenant.namespace, tenant.name))
                counts = (usage.requests, usage.tokens, usage.concurrent)
                if written.get(tenant.key) == counts:
                    continue
                body = {"status": {"usage": usage_status(*counts, time.time(), router_name)}}
                response = await kube.patch(
                    f"/apis/{GROUP}/{VERSION}/namespaces/{tenant.namespace}/{TENANT_PLURAL}"
                    f"/{tenant.name}/status",
                    content=json.dumps(body),
                    headers={"Content-Type": "application/merge-patch+json"},
                )
                response.raise_for_status()
                written[tenant.key] = counts
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("usage of tenant %s not written: %s", tenant.key, exc)
