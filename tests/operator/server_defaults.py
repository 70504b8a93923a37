"""What a real API server makes of a Deployment or Service it stores, for the fields the
builders (and the specs users hand them) emit. kmock's emulator stores objects exactly as sent;
with this, KubeEmulator stores, returns and dry-runs them as the API server does, so the tests
see the differences drift detection must cope with.

Three kinds of change, each rule with its source in Kubernetes:
- `omitempty` zero values are not stored: a false non-pointer bool (`VolumeMount.readOnly`), an
  empty string (`EnvVar.value`, `Toleration.value`), an empty list or map (k8s.io/api core/v1
  types.go JSON tags). Pointer fields keep false (`allowPrivilegeEscalation`,
  `enableServiceLinks`, `automountServiceAccountToken`, `runAsNonRoot`).
- unset fields get defaults (pkg/apis/core/v1/defaults.go, pkg/apis/apps/v1/defaults.go).
- quantities come back canonical (apimachinery resource.Quantity: "1024Mi" -> "1Gi").

Not complete, and need not be: the operator never applies these rules itself (it asks the
server), the tests use them to make the emulator behave like the server.
"""

from __future__ import annotations

import copy
import re
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

# Non-pointer `bool ... omitempty` fields the pod template can carry: false is not stored.
OMITTED_FALSE = {"readOnly", "stdin", "stdinOnce", "tty", "hostNetwork", "hostPID", "hostIPC"}
# Lists that are not `omitempty` (all others are, in the pod template).
KEPT_EMPTY_LISTS = {"containers", "nodeSelectorTerms"}
# `map[string]string ... omitempty` fields.
OMITTED_EMPTY_MAPS = {"labels", "annotations", "nodeSelector", "matchLabels", "limits", "requests"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
_BINARY = [("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)]
_DECIMAL = [
    ("E", 18),
    ("P", 15),
    ("T", 12),
    ("G", 9),
    ("M", 6),
    ("k", 3),
    ("", 0),
    ("m", -3),
    ("u", -6),
    ("n", -9),
]


def stored(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` (a whole Deployment or Service) as the API server stores it; other kinds as given."""
    if kind == "Deployment":
        return stored_deployment(obj)
    if kind == "Service":
        return stored_service(obj)
    return obj


def stored_deployment(obj: dict[str, Any]) -> dict[str, Any]:
    result = _without_empty_maps(copy.deepcopy(obj))
    spec = result.get("spec")
    if not isinstance(spec, dict):
        return result
    # apps/v1 SetDefaults_Deployment.
    spec.setdefault("replicas", 1)
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)
    strategy = spec.setdefault("strategy", {})
    strategy.setdefault("type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        rolling = strategy.setdefault("rollingUpdate", {})
        rolling.setdefault("maxSurge", "25%")
        rolling.setdefault("maxUnavailable", "25%")
    template = spec.get("template")
    if isinstance(template, dict):
        _without_empty_maps(template)
        if isinstance(template.get("spec"), dict):
            template["spec"] = stored_pod_spec(template["spec"])
    return result


def stored_pod_spec(spec: dict[str, Any]) -> dict[str, Any]:
    result = _without_empty(spec)
    # SetDefaults_PodSpec.
    result.setdefault("restartPolicy", "Always")
    result.setdefault("dnsPolicy", "ClusterFirst")
    result.setdefault("schedulerName", "default-scheduler")
    result.setdefault("securityContext", {})
    result.setdefault("terminationGracePeriodSeconds", 30)
    for key in ("containers", "initContainers"):
        if isinstance(result.get(key), list):
            result[key] = [stored_container(container) for container in result[key]]
    for volume in result.get("volumes") or []:
        if isinstance(volume.get("emptyDir"), dict) and "sizeLimit" in volume["emptyDir"]:
            volume["emptyDir"]["sizeLimit"] = canonical_quantity(volume["emptyDir"]["sizeLimit"])
    for toleration in result.get("tolerations") or []:
        for key in ("key", "operator", "value", "effect"):  # `string ... omitempty`
            if toleration.get(key) == "":
                del toleration[key]
    return result


def stored_container(container: dict[str, Any]) -> dict[str, Any]:
    result = copy.deepcopy(container)
    # SetDefaults_Container.
    result.setdefault("terminationMessagePath", "/dev/termination-log")
    result.setdefault("terminationMessagePolicy", "File")
    if not result.get("imagePullPolicy"):
        is_latest = image_tag(str(result.get("image", ""))) == "latest"
        result["imagePullPolicy"] = "Always" if is_latest else "IfNotPresent"
    for port in result.get("ports") or []:
        port.setdefault("protocol", "TCP")
    for var in result.get("env") or []:
        if var.get("value") == "":  # `Value string json:"value,omitempty"`
            del var["value"]
    for probe_key in PROBES:
        probe = result.get(probe_key)
        if isinstance(probe, dict):
            # SetDefaults_Probe, SetDefaults_HTTPGetAction.
            for key, default in (
                ("timeoutSeconds", 1),
                ("periodSeconds", 10),
                ("successThreshold", 1),
                ("failureThreshold", 3),
            ):
                probe.setdefault(key, default)
            if isinstance(probe.get("httpGet"), dict):
                probe["httpGet"].setdefault("path", "/")
                probe["httpGet"].setdefault("scheme", "HTTP")
    resources = result.get("resources")
    if isinstance(resources, dict):
        for kind in ("limits", "requests"):
            if isinstance(resources.get(kind), dict):
                resources[kind] = {k: canonical_quantity(v) for k, v in resources[kind].items()}
    return _without_empty(result)


def stored_service(obj: dict[str, Any]) -> dict[str, Any]:
    result = _without_empty_maps(copy.deepcopy(obj))
    spec = result.get("spec")
    if not isinstance(spec, dict):
        return result
    # SetDefaults_Service, plus what the ClusterIP allocator and the dual-stack defaults add.
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    spec.setdefault("clusterIP", "10.96.0.10")
    spec.setdefault("clusterIPs", [spec["clusterIP"]])
    spec.setdefault("ipFamilies", ["IPv4"])
    spec.setdefault("ipFamilyPolicy", "SingleStack")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
    return result


def image_tag(image: str) -> str:
    """The tag as the kubelet's image-name parser reads it: "latest" when there is none, and ""
    for an image pinned by digest."""
    if "@" in image:
        return ""
    last = image.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else "latest"


def canonical_quantity(value: int | str) -> str:
    """The form the API server returns a quantity in: binary suffixes stay binary (largest
    exact one), the rest becomes the largest exact decimal suffix ("0.5" -> "500m")."""
    amount = parse_quantity(value)
    text = str(value)
    if amount == 0:
        return "0"
    if re.search(r"[KMGTPE]i$", text) and amount == amount.to_integral_value():
        count = int(amount)
        for suffix, factor in _BINARY:
            if count % factor == 0:
                return f"{count // factor}{suffix}"
        return str(count)
    is_exponent = "e" in text.lower()  # "1e3" stays in exponent form
    for suffix, exponent in _DECIMAL:
        scaled = amount / (Decimal(10) ** exponent)
        if scaled == scaled.to_integral_value():
            if is_exponent and exponent:
                return f"{int(scaled)}e{exponent}"
            return f"{int(scaled)}{suffix}"
    return text


def _without_empty(value: Any, *, key: str = "") -> Any:
    """Drops `omitempty` zero values (false bools, empty lists and maps) below `value`."""
    if isinstance(value, dict):
        result = {}
        for name, item in value.items():
            item = _without_empty(item, key=name)
            if name in OMITTED_FALSE and item is False:
                continue
            if isinstance(item, list) and not item and name not in KEPT_EMPTY_LISTS:
                continue
            if isinstance(item, dict) and not item and name in OMITTED_EMPTY_MAPS:
                continue
            result[name] = item
        return result
    if isinstance(value, list):
        return [_without_empty(item, key=key) for item in value]
    return value


def _without_empty_maps(obj: dict[str, Any]) -> dict[str, Any]:
    metadata = obj.get("metadata")
    if isinstance(metadata, dict):
        for name in ("labels", "annotations"):
            if metadata.get(name) == {}:
                del metadata[name]
    return obj
