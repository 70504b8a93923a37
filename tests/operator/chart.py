"""Renders charts/kvpilot with real Helm (helm-python-sdk) and reads its RBAC."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvpilot"


def render(
    values: dict[str, Any] | None = None,
    namespace: str = "kvpilot-system",
    *,
    component: str | None = "operator",
) -> list[dict]:
    """The manifests the chart installs for one component (app.kubernetes.io/component:
    operator or router; None: all), templates only (Helm applies crds/ itself)."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="kvpilot", namespace=namespace, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    if component is None:
        return docs
    return [
        doc
        for doc in docs
        if doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
    ]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def rbac_allows(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(
        group in rule.get("apiGroups", [])
        and (resource in rule.get("resources", []) or "*" in rule.get("resources", []))
        and (verb in rule.get("verbs", []) or "*" in rule.get("verbs", []))
        for rule in rules
    )


def operator_rules(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    (role,) = of_kind(render(values), "ClusterRole")
    return role["rules"]
