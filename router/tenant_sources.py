"""Where a router learns its tenants: the Kubernetes API (Tenant objects and Secrets of the
watched namespaces, list-then-watch like the InferenceServices) or a file of the same manifests
(development and benchmarks without Kubernetes), re-read when it changes. Both feed
kvpilot.router.tenants.TenantDirectory; a key rotated or removed there stops working within a
watch event (Kubernetes) or one poll (the file)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import yaml

from kvpilot.contract.kube import GROUP, VERSION
from kvpilot.contract.tenancy import TENANT_KIND, TENANT_PLURAL
from kvpilot.router.tenants import TenantDirectory

log = logging.getLogger("kvpilot.router")

FILE_POLL_S = 0.5


def tenants_path(namespace: str) -> str:
    """ "" for every namespace."""
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"/apis/{GROUP}/{VERSION}{scope}/{TENANT_PLURAL}"


def read_manifests(text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Tenants and Secrets of a multi-document YAML (other kinds are ignored); ValueError for
    text that is not YAML objects. A Tenant or Secret without a namespace is in `default`, as
    kubectl would put it."""
    tenants, secrets = [], []
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML: {exc}") from None
    for document in documents:
        if not isinstance(document, dict):
            raise ValueError("every document must be a Kubernetes object")
        meta = document.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        if document.get("kind") == TENANT_KIND:
            tenants.append(document)
        elif document.get("kind") == "Secret":
            secrets.append(document)
    return tenants, secrets


async def follow_file(
    path: str, directory: TenantDirectory, *, poll_s: float = FILE_POLL_S
) -> None:
    """Load the file now and again whenever it changes (by mtime and size); a file that does
    not parse keeps the last good tenants (logged once per change). Runs until cancelled."""
    seen: tuple[int, int] | None = None
    problem = ""
    while True:
        try:
            stat = os.stat(path)
            version = (stat.st_mtime_ns, stat.st_size)
            if version != seen:
                seen = version
                tenants, secrets = read_manifests(Path(path).read_text())
                directory.replace(tenants, secrets)
                problem = ""
                log.info("tenants file %s: %d tenants", path, len(directory.tenants))
        except (OSError, ValueError) as exc:
            if str(exc) != problem:
                problem = str(exc)
                log.warning("tenants file %s not loaded (the last good one is kept): %s", path, exc)
        await asyncio.sleep(poll_s)
