"""Has a live child drifted from what we want? Decided without calling the API.

A live object carries much we never set (defaults, status, other controllers' annotations), so
"no drift" means: every field we want is there with our value. Two signals together:
- the config hash annotation catches spec changes, including fields we *stopped* setting (which
  server-side apply then removes);
- the semantic subset check catches someone editing or removing our fields by hand.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvpilot.operator.constants import ANNOTATION_CONFIG_HASH
from kvpilot.operator.quantity import quantities_equal

# Keys whose values are resource quantities the API server canonicalises ("1024Mi" -> "1Gi").
QUANTITY_PARENTS = ("limits", "requests")
QUANTITY_KEYS = ("sizeLimit",)


def config_hash(manifest: dict[str, Any]) -> str:
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def with_config_hash(manifest: dict[str, Any]) -> dict[str, Any]:
    """A copy of `manifest` annotated with the hash of everything else in it but spec.replicas:
    scaling is not a configuration change (and the autoscaler scales without touching the spec).
    """
    metadata = dict(manifest.get("metadata") or {})
    annotations = {
        k: v for k, v in (metadata.get("annotations") or {}).items() if k != ANNOTATION_CONFIG_HASH
    }
    spec = {k: v for k, v in (manifest.get("spec") or {}).items() if k != "replicas"}
    digest = config_hash(
        {**manifest, "metadata": {**metadata, "annotations": annotations}, "spec": spec}
    )
    return {
        **manifest,
        "metadata": {**metadata, "annotations": {**annotations, ANNOTATION_CONFIG_HASH: digest}},
    }


def is_subset(desired: Any, live: Any, *, parent: str = "", key: str = "") -> bool:
    """Whether `live` has every field of `desired` with an equal value.

    Dicts: extra keys in live are fine (defaults, other managers). Lists: same length, each item
    a subset (the server adds defaults inside list items, never items). Quantities by value.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        return all(
            name in live and is_subset(value, live[name], parent=key, key=name)
            for name, value in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return False
        return all(
            is_subset(d, v, parent=parent, key=key) for d, v in zip(desired, live, strict=True)
        )
    if parent in QUANTITY_PARENTS or key in QUANTITY_KEYS:
        return quantities_equal(desired, live)
    return bool(desired == live) and type(desired) is type(live)


def has_drifted(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """Whether applying `desired` (annotated by with_config_hash) would change `live`."""
    if live is None:
        return True
    live_hash = ((live.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_CONFIG_HASH)
    want_hash = desired["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
    return live_hash != want_hash or not is_subset(desired, live)
