"""Everything one router process runs, wired together: the engine and Kubernetes clients, the
watches feeding the registry, and the proxy."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
from prometheus_client import CollectorRegistry

from kvpilot.contract.kube import (
    ENGINE_APP_NAME,
    ENGINE_CONTAINER,
    ENGINE_PORT_NAME,
    LABEL_INSTANCE,
    LABEL_NAME,
)
from kvpilot.router.admission import Admission
from kvpilot.router.cluster import ENGINE_POD_SELECTOR
from kvpilot.router.config import RouterConfig
from kvpilot.router.engine_keys import EngineKeys
from kvpilot.router.kube import (
    KubeAccess,
    list_and_watch,
    pods_path,
    secrets_path,
    services_path,
)
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.proxy import Proxy
from kvpilot.router.quota import QuotaKeeper
from kvpilot.router.registry import Registry
from kvpilot.router.tenant_sources import follow_file, tenants_path
from kvpilot.router.tenant_status import write_usage
from kvpilot.router.tenants import TenantDirectory

log = logging.getLogger("kvpilot.router")


class RouterRuntime:
    def __init__(self, config: RouterConfig, kube: KubeAccess | None) -> None:
        self.config = config
        self.kube_access = kube
        self.metrics = RouterMetrics(CollectorRegistry())
        # Tokenizer fetches (one per model, not per request); requests go over the proxy's own
        # connections, the replicas' block-event streams over an aiohttp session.
        self.engines = httpx.AsyncClient(
            timeout=httpx.Timeout(10.0, read=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.kube = kube.client() if kube is not None else None
        self.engine_keys = EngineKeys(
            self.kube,
            self.metrics,
            fallback=config.engine_api_key,
            refresh_s=config.engine_key_refresh_s,
        )
        self.registry = Registry(config, self.engines, self.metrics, self.engine_keys)
        # With tenants: who they are (from the watches or a file) and their shared quotas.
        self.tenants: TenantDirectory | None = None
        self.quotas: QuotaKeeper | None = None
        admission = None
        if config.tenancy is not None:
            self.tenants = TenantDirectory()
            self.quotas = QuotaKeeper(config.tenancy.quota_store_url)
            admission = Admission(config.tenancy, self.tenants, self.quotas, self.metrics)
        self.proxy = Proxy(config, self.registry, self.kube, self.metrics, admission)
        self._listed: set[tuple[str, str]] = set()
        self._watches: list[asyncio.Task[None]] = []

    @property
    def is_synced(self) -> bool:
        """Every listing in (services, pods; tenants and secrets with tenants from the API)."""
        kinds = 2
        tenancy = self.config.tenancy
        if tenancy is not None and tenancy.tenants_file is None:
            kinds += 2
        if self.config.static_models:
            return tenancy is None or tenancy.tenants_file is not None or self._tenants_listed()
        return len(self._listed) == kinds * len(self.config.namespaces)

    def _tenants_listed(self) -> bool:
        return all(("tenants", n) in self._listed for n in self.config.namespaces)

    async def start(self) -> None:
        # The replicas' block-event streams: long-lived, one per replica.
        self.registry.streams = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0)
        )
        await self._start_tenancy()
        if self.config.static_models:
            services, pods = static_objects(
                self.config.static_models,
                dict(self.config.static_adapters),
                dict(self.config.static_shared_prefixes),
            )
            self.registry.services_listed(STATIC_NAMESPACE, services)
            self.registry.pods_listed(STATIC_NAMESPACE, pods)
            return
        assert self.kube is not None, "watching namespaces needs Kubernetes access"
        self._watches.append(asyncio.create_task(self.engine_keys.run(), name="engine-keys"))
        for namespace in self.config.namespaces:
            self._watches.append(
                asyncio.create_task(
                    list_and_watch(
                        self.kube,
                        services_path(namespace),
                        {},
                        on_list=functools.partial(self._services_listed, namespace),
                        on_event=self.registry.service_event,
                    )
                )
            )
            self._watches.append(
                asyncio.create_task(
                    list_and_watch(
                        self.kube,
                        pods_path(namespace),
                        {"labelSelector": ENGINE_POD_SELECTOR},
                        on_list=functools.partial(self._pods_listed, namespace),
                        on_event=self.registry.pod_event,
                    )
                )
            )

    async def _start_tenancy(self) -> None:
        tenancy, tenants = self.config.tenancy, self.tenants
        if tenancy is None or tenants is None or self.quotas is None:
            return
        await self.quotas.start()
        if tenancy.tenants_file is not None:
            tenants_file = tenancy.tenants_file
            self._watches.append(asyncio.create_task(follow_file(tenants_file, tenants)))
            return
        assert self.kube is not None, "tenants from the API need Kubernetes access"
        for namespace in self.config.namespaces:
            for kind, path, on_list, on_event in (
                ("tenants", tenants_path, tenants.tenants_listed, tenants.tenant_event),
                ("secrets", secrets_path, tenants.secrets_listed, tenants.secret_event),
            ):
                self._watches.append(
                    asyncio.create_task(
                        list_and_watch(
                            self.kube,
                            path(namespace),
                            {},
                            on_list=functools.partial(self._listed_then, kind, namespace, on_list),
                            on_event=on_event,
                        )
                    )
                )
        self._watches.append(
            asyncio.create_task(
                write_usage(self.kube, tenants, self.quotas, tenancy, self.config.router_name)
            )
        )

    def _listed_then(
        self, kind: str, namespace: str, on_list: Callable[[str, list[dict]], None], items: list
    ) -> None:
        on_list(namespace, items)
        self._listed.add((kind, namespace))

    def _services_listed(self, namespace: str, items: list[dict]) -> None:
        self.registry.services_listed(namespace, items)
        self._listed.add(("services", namespace))

    def _pods_listed(self, namespace: str, items: list[dict]) -> None:
        self.registry.pods_listed(namespace, items)
        self._listed.add(("pods", namespace))

    async def stop(self) -> None:
        for task in self._watches:
            task.cancel()
        for task in self._watches:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.registry.close()
        await self.proxy.stop()
        if self.quotas is not None:
            await self.quotas.stop()  # after the settles under way
        if self.registry.streams is not None:
            await self.registry.streams.close()
        await self.engines.aclose()
        if self.kube is not None:
            await self.kube.aclose()


STATIC_NAMESPACE = "static"


def static_objects(
    models: tuple[tuple[str, tuple[str, ...]], ...],
    adapters: dict[str, tuple[str, ...]],
    shared_prefixes: dict[str, tuple[str, ...]] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """InferenceServices and Ready engine pods, as the API would list them, for fixed URLs
    (adapters: model -> the names of the LoRA adapters its engines serve)."""
    services, pods = [], []
    for model, urls in models:
        meta = {"name": model, "namespace": STATIC_NAMESPACE}
        spec = {
            "model": {"servedName": model},
            "adapters": [{"name": name, "uri": ""} for name in adapters.get(model, ())],
            "sharedPrefixes": list((shared_prefixes or {}).get(model, ())),
        }
        services.append({"metadata": meta, "spec": spec})
        for i, url in enumerate(urls):
            parsed = urlsplit(url)
            pods.append(
                {
                    "metadata": {
                        "name": f"{model}-{i}",
                        "namespace": STATIC_NAMESPACE,
                        "labels": {LABEL_NAME: ENGINE_APP_NAME, LABEL_INSTANCE: model},
                    },
                    "spec": {
                        "containers": [
                            {
                                "name": ENGINE_CONTAINER,
                                "ports": [{"name": ENGINE_PORT_NAME, "containerPort": parsed.port}],
                            }
                        ]
                    },
                    "status": {
                        "podIP": parsed.hostname,
                        "conditions": [{"type": "Ready", "status": "True"}],
                    },
                }
            )
    return services, pods
