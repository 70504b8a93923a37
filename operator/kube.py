"""Every Kubernetes API call the operator's own code makes, as plain dicts in and out.

kopf makes its own calls (watching, its annotations, Events); the chart's ClusterRole grants both
(tests/operator checks it against the requests a real run makes). The kubernetes client is used
without its model classes: bodies stay the JSON the API speaks, which is what builders produce
and what drift detection compares.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from typing import Any

import kubernetes
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from kvpilot.contract.kube import GROUP, PLURAL, VERSION
from kvpilot.contract.tenancy import TENANT_PLURAL
from kvpilot.operator.constants import (
    AUTOSCALER_FIELD_MANAGER,
    DEFAULT_API_TIMEOUT_SECONDS,
    FIELD_MANAGER,
)

# A hung API server must fail the call (a retryable KubeError), not hold the operator: connecting
# gets at most this much of a call's timeout.
CONNECT_TIMEOUT_SECONDS = 5.0
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_PATCH_CONTENT_TYPE = "application/merge-patch+json"

# What this module calls, as RBAC sees it: (apiGroup, resource, verb). A dry-run apply needs
# the same verb as the apply itself (patch).
API_CALLS = (
    ("apps", "deployments", "get"),
    ("apps", "deployments", "create"),
    ("apps", "deployments", "patch"),
    ("", "services", "get"),
    ("", "services", "create"),
    ("", "services", "patch"),
    ("policy", "poddisruptionbudgets", "get"),
    ("policy", "poddisruptionbudgets", "create"),
    ("policy", "poddisruptionbudgets", "patch"),
    ("policy", "poddisruptionbudgets", "delete"),
    ("networking.k8s.io", "networkpolicies", "get"),
    ("networking.k8s.io", "networkpolicies", "create"),
    ("networking.k8s.io", "networkpolicies", "patch"),
    ("networking.k8s.io", "networkpolicies", "delete"),
    ("", "pods", "list"),
    (GROUP, PLURAL, "get"),
    (GROUP, f"{PLURAL}/status", "patch"),
    (GROUP, TENANT_PLURAL, "get"),
    (GROUP, f"{TENANT_PLURAL}/status", "patch"),
)
# Only where the chart grants it (rbac.readApiKeySecrets): the adapter sync reads the engine's
# API key (spec.engine.apiKeySecret) to call the adapter API of a service that has one, and the
# Tenant check counts the keys of the Secrets a Tenant names.
OPTIONAL_API_CALLS = (("", "secrets", "get"),)


class KubeError(RuntimeError):
    """An API call failed; `is_retryable` says whether trying again later can help."""

    def __init__(self, message: str, *, status: int | None, is_retryable: bool) -> None:
        super().__init__(message)
        self.status = status
        self.is_retryable = is_retryable


def request_timeout(seconds: float) -> tuple[float, float]:
    """The client's (connect, read) timeouts for calls that may take `seconds`."""
    return (min(CONNECT_TIMEOUT_SECONDS, seconds), seconds)


def connect() -> kubernetes.client.ApiClient:
    """In-cluster service account first, then $KUBECONFIG (read now, not at import)."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or None,
            client_configuration=configuration,
            persist_config=False,
        )
    return kubernetes.client.ApiClient(configuration)


class KubeApi:
    """Typed API objects behind a handful of dict-in, dict-out calls, each bounded by
    `timeout_seconds` (a call that times out is a retryable KubeError)."""

    def __init__(
        self,
        client: kubernetes.client.ApiClient,
        *,
        timeout_seconds: float = DEFAULT_API_TIMEOUT_SECONDS,
    ) -> None:
        # Skip the client's model classes: the raw HTTP response, decoded by _call.
        self._raw: dict[str, Any] = {
            "_preload_content": False,
            "_request_timeout": request_timeout(timeout_seconds),
        }
        self._apps = kubernetes.client.AppsV1Api(client)
        self._core = kubernetes.client.CoreV1Api(client)
        self._custom = kubernetes.client.CustomObjectsApi(client)
        self._policy = kubernetes.client.PolicyV1Api(client)
        self._networking = kubernetes.client.NetworkingV1Api(client)

    # -- children --------------------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        read = {
            "Deployment": self._apps.read_namespaced_deployment,
            "Service": self._core.read_namespaced_service,
            "PodDisruptionBudget": self._policy.read_namespaced_pod_disruption_budget,
            "NetworkPolicy": self._networking.read_namespaced_network_policy,
        }[kind]
        return _call_or_none(lambda: read(name, namespace, **self._raw))

    def delete(self, kind: str, namespace: str, name: str) -> None:
        """Deletes an optional child the spec no longer asks for (gone already is fine)."""
        remove = {
            "PodDisruptionBudget": self._policy.delete_namespaced_pod_disruption_budget,
            "NetworkPolicy": self._networking.delete_namespaced_network_policy,
        }[kind]
        _call_or_none(lambda: remove(name, namespace, **self._raw))

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create-or-patch by server-side apply; we own exactly the fields we send. Returns the
        object as the server stored it.

        SSA creates a missing object itself; the create fallback serves API servers (and test
        emulators) that answer 404 instead, and a concurrent create (409) goes back to apply.
        """
        _, create = self._writers(manifest["kind"])
        metadata = manifest["metadata"]
        try:
            return self._server_side_apply(manifest)
        except KubeError as error:
            if error.status != 404:
                raise
        try:
            return _call(
                lambda: create(
                    metadata["namespace"], manifest, field_manager=FIELD_MANAGER, **self._raw
                )
            )
        except KubeError as error:
            if error.status != 409:
                raise
        return self._server_side_apply(manifest)

    def dry_run_apply(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """What apply would make of the live object, without changing it (`dryRun=All`): the
        server's defaults, dropped zero values and canonical quantities included. None when the
        object does not exist (for servers that answer 404, as apply's fallback expects).
        """
        try:
            return self._server_side_apply(manifest, dry_run=True)
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    def _writers(self, kind: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """(patch, create) of `kind`."""
        return {
            "Deployment": (
                self._apps.patch_namespaced_deployment,
                self._apps.create_namespaced_deployment,
            ),
            "Service": (
                self._core.patch_namespaced_service,
                self._core.create_namespaced_service,
            ),
            "PodDisruptionBudget": (
                self._policy.patch_namespaced_pod_disruption_budget,
                self._policy.create_namespaced_pod_disruption_budget,
            ),
            "NetworkPolicy": (
                self._networking.patch_namespaced_network_policy,
                self._networking.create_namespaced_network_policy,
            ),
        }[kind]

    def _server_side_apply(
        self, manifest: dict[str, Any], *, dry_run: bool = False
    ) -> dict[str, Any]:
        patch, _ = self._writers(manifest["kind"])
        metadata = manifest["metadata"]
        options: dict[str, Any] = {"dry_run": "All"} if dry_run else {}
        return _call(
            lambda: patch(
                metadata["name"],
                metadata["namespace"],
                manifest,
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type=APPLY_CONTENT_TYPE,
                **options,
                **self._raw,
            )
        )

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        """Sets only spec.replicas, as the autoscaler (its own field manager) does."""
        _call(
            lambda: self._apps.patch_namespaced_deployment(
                name,
                namespace,
                {"spec": {"replicas": replicas}},
                field_manager=AUTOSCALER_FIELD_MANAGER,
                _content_type=MERGE_PATCH_CONTENT_TYPE,
                **self._raw,
            )
        )

    def list_pods(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        text = ",".join(f"{key}={value}" for key, value in selector.items())
        listing = _call(
            lambda: self._core.list_namespaced_pod(namespace, label_selector=text, **self._raw)
        )
        # The server filters by the selector already; filtering again costs nothing and keeps a
        # stray pod (from a server or proxy that ignores selectors) out of the diagnosis.
        return [
            pod
            for pod in listing.get("items") or []
            if all(
                ((pod.get("metadata") or {}).get("labels") or {}).get(key) == value
                for key, value in selector.items()
            )
        ]

    def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        """One key of a Secret, decoded (None when the Secret or the key is missing)."""
        secret = _call_or_none(
            lambda: self._core.read_namespaced_secret(name, namespace, **self._raw)
        )
        encoded = ((secret or {}).get("data") or {}).get(key)
        if encoded is None:
            return None
        try:
            return base64.b64decode(encoded).decode("utf-8").strip()
        except (ValueError, UnicodeDecodeError):
            return None

    def read_secret_entries(self, namespace: str, name: str) -> frozenset[str] | None:
        """The names of a Secret's entries that hold a non-empty value (None when the Secret is
        missing). Values never leave this method: a caller can count keys, not learn them."""
        secret = _call_or_none(
            lambda: self._core.read_namespaced_secret(name, namespace, **self._raw)
        )
        if secret is None:
            return None
        data = secret.get("data") or {}
        return frozenset(entry for entry, encoded in data.items() if _decodes_non_empty(encoded))

    # -- the Tenant --------------------------------------------------------------------------

    def get_tenant(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _call_or_none(
            lambda: self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, TENANT_PLURAL, name, **self._raw
            )
        )

    def patch_tenant_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        # A merge patch of the operator's keys only: the routers' status.usage stays.
        _call(
            lambda: self._custom.patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                namespace,
                TENANT_PLURAL,
                name,
                {"status": status},
                _content_type=MERGE_PATCH_CONTENT_TYPE,
                **self._raw,
            )
        )

    # -- the InferenceService ----------------------------------------------------------------

    def get_inferenceservice(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _call_or_none(
            lambda: self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, **self._raw
            )
        )

    def patch_inferenceservice_status(
        self, namespace: str, name: str, status: dict[str, Any]
    ) -> None:
        # A merge patch of only the keys given: the autoscaler's keys stay as they are.
        _call(
            lambda: self._custom.patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                {"status": status},
                _content_type=MERGE_PATCH_CONTENT_TYPE,
                **self._raw,
            )
        )


def _call(request: Callable[[], Any]) -> dict[str, Any]:
    try:
        response = request()
    except ApiException as error:
        status = error.status
        retryable = status in (409, 429) or (status is not None and status >= 500)
        raise KubeError(
            f"API error {status} {error.reason}: {_message(error)}",
            status=status,
            is_retryable=retryable,
        ) from error
    except (urllib3.exceptions.HTTPError, OSError) as error:
        # A timeout (urllib3's own, or the last of its retries of a read) means a slow or hung
        # API server; a write may or may not have been applied, and the retry looks again.
        timed_out = isinstance(error, urllib3.exceptions.TimeoutError) or isinstance(
            getattr(error, "reason", None), urllib3.exceptions.TimeoutError
        )
        what = "API call timed out" if timed_out else "API unreachable"
        raise KubeError(f"{what}: {error}", status=None, is_retryable=True) from error
    data = response.data
    try:
        return json.loads(data) if data else {}
    except ValueError:
        # A proxy or load balancer in front of the API server answering with its own page: a
        # failed call (retried later), not a crash inside a handler.
        raise KubeError(
            f"API answered {response.status} with a body that is not JSON: {data[:200]!r}",
            status=response.status,
            is_retryable=True,
        ) from None


def _decodes_non_empty(encoded: Any) -> bool:
    """Whether a Secret's data entry holds a key: base64 of a non-blank UTF-8 text."""
    try:
        return bool(base64.b64decode(encoded, validate=True).decode("utf-8").strip())
    except (TypeError, ValueError, UnicodeDecodeError):
        return False


def _call_or_none(request: Callable[[], Any]) -> dict[str, Any] | None:
    try:
        return _call(request)
    except KubeError as error:
        if error.status == 404:
            return None
        raise


def _message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body).get("message") or error.body)
    except (TypeError, ValueError, AttributeError):
        return str(error.body)
