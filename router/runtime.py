"""Everything one router process runs, wired together: the engine and Kubernetes clients, the
watches feeding the registry, and the proxy."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

import httpx
from prometheus_client import CollectorRegistry

from kvpilot.router.cluster import ENGINE_POD_SELECTOR
from kvpilot.router.config import RouterConfig
from kvpilot.router.kube import KubeAccess, list_and_watch, pods_path, services_path
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.proxy import Proxy
from kvpilot.router.registry import Registry

log = logging.getLogger("kvpilot.router")


class RouterRuntime:
    def __init__(self, config: RouterConfig, kube: KubeAccess) -> None:
        self.config = config
        self.kube_access = kube
        self.metrics = RouterMetrics(CollectorRegistry())
        # No pool limit: every in-flight request holds a connection; keep-alive saves the
        # connect on the next one.
        self.engines = httpx.AsyncClient(
            timeout=httpx.Timeout(10.0, read=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.kube = kube.client()
        self.registry = Registry(config, self.engines, self.metrics)
        self.proxy = Proxy(config, self.registry, self.engines, self.kube, self.metrics)
        self._listed: set[tuple[str, str]] = set()
        self._watches: list[asyncio.Task[None]] = []

    @property
    def is_synced(self) -> bool:
        return len(self._listed) == 2 * len(self.config.namespaces)

    async def start(self) -> None:
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
        await self.engines.aclose()
        await self.kube.aclose()
