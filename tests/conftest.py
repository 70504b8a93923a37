"""Shared test setup: markers that skip with a clear reason when their hardware is absent; kmock's
request matching in linear rather than quadratic time (tests/kmock_membership.py); the longest
files first, so that CI's two workers (.ci/test) do not end with one of them alone on a long one."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .kmock_membership import fast_request_membership

# The longest files first, so that CI's two workers end together: by their totals (pytest
# --durations=0 summed per file) on a quiet 2-core machine (drift 74 s ... async 16 s) and on a
# loaded one, where the compute-bound files grow most (sampling 1064 s, attention 826 s).
LONGEST_FILES = (
    "tests/engine/test_sampling_and_api.py",
    "tests/kernels/test_attention.py",
    "tests/engine/test_parity_smollm2.py",
    "tests/operator/test_drift_emulated.py",
    "tests/router/test_router_loopback.py",
    "tests/server/test_core_process.py",
    "tests/server/test_structured_outputs.py",
    "tests/router/test_tenancy_loopback.py",
    "tests/server/test_lora_serve.py",
    "tests/engine/test_cpu_attention.py",
    "tests/engine/test_import_structure.py",
    "tests/operator/test_operator_emulated.py",
    "tests/engine/test_lora_parity.py",
    "tests/operator/test_restart_emulated.py",
    "tests/engine/test_async_scheduling.py",
)


@pytest.fixture(scope="session", autouse=True)
def _kmock_fast_request_membership() -> Iterator[None]:
    with fast_request_membership():
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    order = {name: index for index, name in enumerate(LONGEST_FILES)}
    # Stable: the order within a file, and of the other files, is pytest's.
    items.sort(key=lambda item: order.get(item.path.relative_to(root).as_posix(), len(order)))
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
