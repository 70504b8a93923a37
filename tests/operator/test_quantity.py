from __future__ import annotations

from decimal import Decimal

import pytest

from kvpilot.operator.quantity import parse_quantity, quantities_equal


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", Decimal(1)),
        (2, Decimal(2)),
        ("500m", Decimal("0.5")),
        ("0.5", Decimal("0.5")),
        ("1Ki", Decimal(1024)),
        ("16Gi", Decimal(16 * 2**30)),
        ("1.5G", Decimal(1_500_000_000)),
        ("1e3", Decimal(1000)),
        ("5E-2", Decimal("0.05")),
        ("100n", Decimal("1e-7")),
    ],
)
def test_parses_the_kubernetes_grammar(text: str | int, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["abc", "1.2.3", "10XB", "", "Gi", True])
def test_rejects_what_kubernetes_rejects(text: object) -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity(text)  # type: ignore[arg-type]


def test_compares_canonical_forms_by_value() -> None:
    # The API server returns "1Gi" for "1024Mi" and "1" for 1: neither is drift.
    assert quantities_equal("1024Mi", "1Gi")
    assert quantities_equal(1, "1")
    assert quantities_equal("0.5", "500m")
    assert not quantities_equal("1Gi", "1G")
