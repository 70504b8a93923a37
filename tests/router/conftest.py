"""The router tests reuse the operator tests' kmock set-up (emulator class, kubeconfig)."""

from __future__ import annotations

from ..operator.conftest import kubeconfig

__all__ = ["kubeconfig"]
