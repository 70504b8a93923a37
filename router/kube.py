"""The router's Kubernetes API access over httpx: where the API server is (in-cluster or
kubeconfig), list-then-watch loops that survive disconnects, and the one write the router makes
(asking for a model to be woken)."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpilot.contract.kube import ANNOTATION_WAKE, GROUP, PLURAL, VERSION

log = logging.getLogger("kvpilot.router")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Set by routers on an InferenceService whose requests they hold at zero replicas; the operator
# scales it up at once (a watch event, not a scrape tick).
WAKE_ANNOTATION = ANNOTATION_WAKE
_RELIST_PAUSE_S = 1.0


@dataclass(frozen=True)
class KubeAccess:
    base_url: str
    headers: dict[str, str] = field(default_factory=dict)
    verify: str | bool = True
    cert: tuple[str, str] | None = None

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url,
            headers=self.headers,
            verify=self.verify,
            cert=self.cert,
            timeout=httpx.Timeout(10.0, read=None),
        )


def kube_access() -> KubeAccess:
    """In a pod: its service account; elsewhere: the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if host and (SERVICE_ACCOUNT / "token").exists():
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
        return KubeAccess(
            f"https://{host}:{port}",
            {"Authorization": f"Bearer {token}"},
            str(SERVICE_ACCOUNT / "ca.crt"),
        )
    import kubernetes

    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(client_configuration=config)
    headers = {}
    auth = config.api_key.get("authorization") or config.api_key.get("BearerToken")
    if auth:
        headers["Authorization"] = auth if auth.startswith("Bearer ") else f"Bearer {auth}"
    cert = (config.cert_file, config.key_file) if config.cert_file and config.key_file else None
    verify: str | bool = config.ssl_ca_cert or config.verify_ssl
    return KubeAccess(config.host.rstrip("/"), headers, verify, cert)


def services_path(namespace: str) -> str:
    """ "" for every namespace."""
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"/apis/{GROUP}/{VERSION}{scope}/{PLURAL}"


def pods_path(namespace: str) -> str:
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"/api/v1{scope}/pods"


def secrets_path(namespace: str) -> str:
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"/api/v1{scope}/secrets"


async def list_and_watch(
    client: httpx.AsyncClient,
    path: str,
    params: dict[str, str],
    *,
    on_list: Callable[[list[dict[str, Any]]], None],
    on_event: Callable[[str, dict[str, Any]], None],
) -> None:
    """List, then watch from the list's resourceVersion; after any failure (410 Gone included),
    list again. Runs until cancelled."""
    while True:
        try:
            listing = await client.get(path, params=params)
            listing.raise_for_status()
            body = listing.json()
            on_list(body.get("items") or [])
            version = (body.get("metadata") or {}).get("resourceVersion") or ""
            watch = {**params, "watch": "true", "allowWatchBookmarks": "true"}
            if version:
                watch["resourceVersion"] = version
            async with client.stream("GET", path, params=watch) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind = event.get("type")
                    if kind == "ERROR":
                        raise RuntimeError(f"watch {path}: {event.get('object')}")
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        on_event(kind, event["object"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("watch %s interrupted (%s); listing again", path, exc)
        await asyncio.sleep(_RELIST_PAUSE_S)


async def request_wake(
    client: httpx.AsyncClient, namespace: str, name: str, router_name: str
) -> None:
    """Annotate the InferenceService so the operator scales it from zero now."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    body = {"metadata": {"annotations": {WAKE_ANNOTATION: f"{now} {router_name}"}}}
    response = await client.patch(
        f"{services_path(namespace)}/{name}",  # namespace is the service's own, never ""
        content=json.dumps(body),
        headers={"Content-Type": "application/merge-patch+json"},
    )
    response.raise_for_status()
