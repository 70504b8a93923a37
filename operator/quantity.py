"""Kubernetes resource quantities ("500m", "16Gi", "1e3", 2) as exact decimals.

The API server stores quantities in canonical form ("1024Mi" comes back as "1Gi"), so drift
detection compares them by value, never as strings.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# The same grammar as apimachinery's resource.Quantity (and the CRD pattern controller-gen emits).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+"
    r"(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_NUMBER = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(.*)$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}


def parse_quantity(value: str | int | float) -> Decimal:
    """Returns the quantity's exact value; raises ValueError on anything Kubernetes would reject."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int | float):
        return Decimal(str(value))
    if not isinstance(value, str) or not re.fullmatch(QUANTITY_PATTERN, value):
        raise ValueError(
            f"{value!r} is not a Kubernetes quantity (examples: 500m, 2, 16Gi, 1.5G, 1e3)"
        )
    match = _NUMBER.match(value)
    assert match is not None  # the pattern above guarantees a leading number
    number, suffix = Decimal(match.group(1)), match.group(2)
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    try:
        return number * Decimal(10) ** int(suffix[1:])  # exponent form: "1e3", "5E-2"
    except (InvalidOperation, ValueError) as error:
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from error


def quantities_equal(a: object, b: object) -> bool:
    """Compares two quantities by value; anything unparsable compares as plain values."""
    try:
        return parse_quantity(a) == parse_quantity(b)  # type: ignore[arg-type]
    except ValueError:
        return a == b
