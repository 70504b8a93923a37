"""Has a live child drifted from what we applied? Decided without calling the API.

A live object carries much we never set (defaults, status, other controllers' annotations), and
the API server does not store what we send as we send it: it drops `omitempty` zero values
(`readOnly: false`, `value: ""`, empty lists), fills in defaults and canonicalises quantities
("1024Mi" -> "1Gi"). So the desired manifest is never compared with the live object as sent:
`stored_fields` first puts it in the form the server stores it in, taken from the server's own
answer to applying it (the apply response, or a dry-run apply). "No drift" then means: every one
of our fields is live with the value the server made of it. Two signals together:
- the config hash annotation catches spec changes, including fields we *stopped* setting (which
  server-side apply then removes);
- the subset check of the stored form catches someone editing or removing our fields by hand.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final

from kubernetes.utils import parse_quantity

from kvpilot.operator.constants import ANNOTATION_CONFIG_HASH

# Keys whose values are resource quantities the API server canonicalises ("1024Mi" -> "1Gi").
QUANTITY_PARENTS = ("limits", "requests")
QUANTITY_KEYS = ("sizeLimit",)


class _Absent:
    """The value of a field we send that the server does not store (a zero value it omits)."""

    def __repr__(self) -> str:
        return "ABSENT"


# After our apply such a field is absent, so a live value there is someone else's edit.
ABSENT: Final = _Absent()


def quantities_equal(a: object, b: object) -> bool:
    """Compares two quantities by value ("1024Mi" is "1Gi"); anything unparsable as plain values."""
    try:
        return parse_quantity(a) == parse_quantity(b)
    except (ValueError, TypeError):
        return a == b


def config_hash(manifest: dict[str, Any]) -> str:
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_hash_of(manifest: dict[str, Any]) -> str | None:
    """The hash with_config_hash annotated `manifest` (desired or live) with, if any."""
    return ((manifest.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_CONFIG_HASH)


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


def stored_fields(desired: Any, served: Any) -> Any:
    """`desired` in the form the API server stores it: each of its fields with the value it has in
    `served` (the server's answer to applying `desired`), ABSENT where the server dropped it.

    Fields only the server has (defaults, status) stay out: they are not ours. Lists pair items
    by position; items the server has beyond ours (another manager's, which our apply leaves in
    place) are kept whole, so that they never count as drift.
    """
    if isinstance(desired, dict) and isinstance(served, dict):
        return {
            key: stored_fields(value, served[key]) if key in served else ABSENT
            for key, value in desired.items()
        }
    if isinstance(desired, list) and isinstance(served, list):
        paired = [stored_fields(d, s) for d, s in zip(desired, served, strict=False)]
        return paired + served[len(desired) :]
    return served


def is_subset(desired: Any, live: Any, *, parent: str = "", key: str = "") -> bool:
    """Whether `live` has every field of `desired` with an equal value (and none that `desired`
    says is ABSENT).

    Dicts: extra keys in live are fine (defaults, other managers). Lists: same length, each item
    a subset (the server adds defaults inside list items, never items). Quantities by value.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        return all(
            name not in live
            if value is ABSENT
            else name in live and is_subset(value, live[name], parent=key, key=name)
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


def has_drifted(expected: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """Whether applying `expected` would change `live`.

    `expected` is the desired manifest (annotated by with_config_hash) in the form the server
    stores it (`stored_fields(desired, served)`). The raw desired manifest serves only where the
    server stores every field as sent: it has no `omitempty` zero value and no unset default.
    """
    if live is None:
        return True
    return config_hash_of(live) != config_hash_of(expected) or not is_subset(expected, live)
