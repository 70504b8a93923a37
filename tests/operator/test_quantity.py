"""Quantities: the spec's Quantity type accepts what Kubernetes accepts (and the CRD pattern says),
and drift compares quantities by value (kubernetes.utils.parse_quantity does the arithmetic)."""

from __future__ import annotations

import re

import pytest
from pydantic import TypeAdapter, ValidationError

from kvpilot.operator.drift import quantities_equal
from kvpilot.operator.kubetypes import QUANTITY_PATTERN, Quantity

QUANTITY = TypeAdapter(Quantity)


@pytest.mark.parametrize(
    "text", ["1", 2, "500m", "0.5", "1Ki", "16Gi", "1.5G", "1e3", "5E-2", "100n", "+1", ".5"]
)
def test_accepts_the_kubernetes_grammar(text: str | int) -> None:
    assert QUANTITY.validate_python(text) == text
    if isinstance(text, str):
        assert re.fullmatch(QUANTITY_PATTERN, text)


@pytest.mark.parametrize("text", ["abc", "1.2.3", "10XB", "", "Gi", "1e", "1 Gi"])
def test_rejects_what_kubernetes_rejects(text: object) -> None:
    with pytest.raises(ValidationError, match="not a Kubernetes quantity"):
        QUANTITY.validate_python(text)


def test_compares_canonical_forms_by_value() -> None:
    # The API server returns "1Gi" for "1024Mi" and "1" for 1: neither is drift.
    assert quantities_equal("1024Mi", "1Gi")
    assert quantities_equal(1, "1")
    assert quantities_equal("0.5", "500m")
    assert not quantities_equal("1Gi", "1G")
    assert quantities_equal("lots", "lots") and not quantities_equal("lots", "1")
