"""Shared test setup: markers that skip with a clear reason when their hardware is absent; kmock's
request matching in linear rather than quadratic time (tests/kmock_membership.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .kmock_membership import fast_request_membership


@pytest.fixture(scope="session", autouse=True)
def _kmock_fast_request_membership() -> Iterator[None]:
    with fast_request_membership():
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cluster = bool(os.environ.get("KUBECONFIG"))
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:  # the operator's tests need no torch
        has_gpu = False
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none present)"))
        if "k8s" in item.keywords and not has_cluster:
            item.add_marker(
                pytest.mark.skip(
                    reason="needs a real Kubernetes cluster: set KUBECONFIG (see e2e/)"
                )
            )
