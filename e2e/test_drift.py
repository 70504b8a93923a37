"""On a real cluster: the API server drops and defaults fields of what the operator applies
(`readOnly: false` on a builtin:// model's cache mount, pull policy, probe defaults ...), and none
of that is drift; a hand edit of the Deployment is, repaired and reported exactly once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from .cluster import wait_for, wait_ready
from .conftest import GROUP, PLURAL, RESYNC_SECONDS, ROOT, VERSION, E2ESettings

pytestmark = pytest.mark.k8s

NAME = "smollm2-drift"
HAND_EDITED_IMAGE = "registry.invalid/hand-edited:1"


@pytest.fixture(scope="module")
def served(release: str, e2e: E2ESettings, apis: dict[str, Any]) -> Iterator[str]:
    """The CPU example (a builtin:// model: its cache mount has readOnly: false) under NAME."""
    body = yaml.safe_load((ROOT / "examples" / "smollm2-cpu.yaml").read_text())
    body["metadata"] = {"name": NAME, "namespace": e2e.namespace}
    apis["custom"].create_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, body)
    yield NAME
    with contextlib.suppress(Exception):
        apis["custom"].delete_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, NAME)


def drift_repairs(apis: dict[str, Any], e2e: E2ESettings) -> int:
    """DriftRepaired Events of NAME (an Event's count says how often it was repeated)."""
    events = apis["core"].list_namespaced_event(
        e2e.namespace,
        field_selector=f"involvedObject.name={NAME},involvedObject.kind=InferenceService",
    )
    return sum(event.count or 1 for event in events.items if event.reason == "DriftRepaired")


def engine_image(apis: dict[str, Any], e2e: E2ESettings) -> str:
    deployment = apis["apps"].read_namespaced_deployment(NAME, e2e.namespace)
    return str(deployment.spec.template.spec.containers[0].image)


def operator_applies(
    apis: dict[str, Any], e2e: E2ESettings, pod_logs: Callable[[str, str], str]
) -> int:
    """How often the operator has logged applying NAME's Deployment so far."""
    operator = apis["apps"].read_namespaced_deployment("kvpilot", e2e.operator_namespace)
    selector = ",".join(f"{k}={v}" for k, v in operator.spec.selector.match_labels.items())
    pods = apis["core"].list_namespaced_pod(e2e.operator_namespace, label_selector=selector)
    line = f"applied Deployment {e2e.namespace}/{NAME}"
    return sum(
        pod_logs(e2e.operator_namespace, pod.metadata.name).count(line) for pod in pods.items
    )


def test_an_unchanged_deployment_is_never_drift(
    served: str, e2e: E2ESettings, apis: dict[str, Any], pod_logs: Callable[[str, str], str]
) -> None:
    # Becoming Ready changes the Deployment many times (status, revision annotation): each
    # change and each resync reconciles it.
    wait_ready(apis, e2e, NAME)
    applied = operator_applies(apis, e2e, pod_logs)
    assert applied >= 1  # the log is read where the apply is logged
    time.sleep(2 * RESYNC_SECONDS + 2)
    assert drift_repairs(apis, e2e) == 0
    # Nor a silent re-apply: the operator logs every apply.
    assert operator_applies(apis, e2e, pod_logs) == applied


def test_a_hand_edit_is_repaired_and_reported_once(
    served: str, e2e: E2ESettings, apis: dict[str, Any]
) -> None:
    original = engine_image(apis, e2e)
    assert drift_repairs(apis, e2e) == 0
    # What `kubectl set image` does: a strategic merge patch under its own field manager.
    patch = {
        "spec": {
            "template": {"spec": {"containers": [{"name": "engine", "image": HAND_EDITED_IMAGE}]}}
        }
    }
    apis["apps"].patch_namespaced_deployment(
        NAME, e2e.namespace, patch, field_manager="kubectl-set"
    )
    wait_for(
        lambda: engine_image(apis, e2e) == original,
        60,
        "the operator to restore the image",
        interval=1,
        describe=lambda: engine_image(apis, e2e),
    )
    wait_for(
        lambda: drift_repairs(apis, e2e) >= 1,
        30,
        "the DriftRepaired Event",
        interval=1,
    )
    # Two resyncs later: still exactly one, and the image still ours.
    time.sleep(2 * RESYNC_SECONDS + 2)
    assert drift_repairs(apis, e2e) == 1
    assert engine_image(apis, e2e) == original
