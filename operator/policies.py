"""Pure builders of the optional children that protect an InferenceService: its
PodDisruptionBudget and its NetworkPolicy. None means "this service should have none" (reconcile
then deletes one it made before).
"""

from __future__ import annotations

from typing import Any

from kvpilot.contract.kube import ENGINE_PORT_NAME, NETWORK_PEER_LABELS
from kvpilot.operator.builders import Owner, child_metadata, selector_labels
from kvpilot.operator.spec import InferenceServiceSpec

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace since 1.22


def most_replicas(spec: InferenceServiceSpec) -> int:
    """The most engine pods the service may run: maxReplicas when autoscaled."""
    if spec.autoscaling is not None:
        return spec.autoscaling.policy.max_replicas
    return spec.effective_replicas


def build_pod_disruption_budget(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """One pod at a time may be evicted (a node drain, a cluster upgrade), for services that can
    have more than one.

    maxUnavailable 1 (not minAvailable) never blocks a drain for good: with one pod left (an
    autoscaled service at its minimum) that pod may still go, and AlwaysAllow lets pods that are
    not Ready (crash-looping, still loading) be evicted whatever the budget says. A single-replica
    service gets no budget: one that allowed nothing would hold every drain forever.
    """
    if most_replicas(spec) <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(owner),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def build_network_policy(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """Ingress to the engine port from kvpilot's own pods (any namespace) and from the pods of
    spec.networkPolicy.allowNamespaces; nothing else. None without spec.networkPolicy."""
    if spec.network_policy is None:
        return None
    peers: list[dict[str, Any]] = [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(NETWORK_PEER_LABELS)}}
    ]
    if spec.network_policy.allow_namespaces:
        names = sorted(set(spec.network_policy.allow_namespaces))
        peers.append(
            {
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": names}
                    ]
                }
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(owner),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(owner.name)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"port": ENGINE_PORT_NAME, "protocol": "TCP"}]}],
        },
    }
