"""The benchmarks' figures: matplotlib without a display (each figure is written to a file)."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, imported on first use (only reports need it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
