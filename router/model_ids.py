"""Which InferenceService every `model` id goes to: a served model name or a LoRA adapter's name.

A `model` id names one thing. Where InferenceServices claim the same id, served model names are
claimed first, then adapters' names, each by the older service (creationTimestamp, then
namespace and name): an adapter added to one service never takes another service's model away,
and a new service never takes an id that an older one serves. A service that loses its served
model name is not served at all (nor are its adapters). The router logs each conflict and lists
only the winner; requests for the id go to the winner.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpilot.router.cluster import Adapter, ServiceInfo

ServiceKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Claims:
    """Which service keeps each `model` id, and the claims that lost (winner, loser, id)."""

    models: dict[str, ServiceInfo]  # served model name -> its service
    adapters: dict[str, tuple[ServiceInfo, Adapter]]  # adapter name -> its service
    conflicts: frozenset[tuple[str, ServiceKey, ServiceKey]]


def claim_model_ids(services: Iterable[ServiceInfo]) -> Claims:
    """Served model names first, then adapters' names, each to the older service."""
    ordered = sorted(services, key=lambda s: (s.created, s.namespace, s.name))
    taken: dict[str, ServiceInfo] = {}
    conflicts: set[tuple[str, ServiceKey, ServiceKey]] = set()

    def claim(model_id: str, info: ServiceInfo) -> bool:
        winner = taken.setdefault(model_id, info)
        if winner is not info:
            conflicts.add((model_id, (winner.namespace, winner.name), (info.namespace, info.name)))
        return winner is info

    models = {info.model: info for info in ordered if claim(info.model, info)}
    adapters = {
        adapter.name: (info, adapter)
        for info in ordered
        if models.get(info.model) is info  # a service that is not served serves no adapter
        for adapter in info.adapters
        if claim(adapter.name, info)
    }
    return Claims(models, adapters, frozenset(conflicts))
