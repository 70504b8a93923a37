from __future__ import annotations

import copy
from typing import Any

import pytest

from kvpilot.operator.builders import Owner, build_deployment
from kvpilot.operator.drift import ABSENT, has_drifted, is_subset, stored_fields, with_config_hash
from kvpilot.operator.reconcile import is_controlled_by, replicas_for
from kvpilot.operator.spec import parse_spec

from .server_defaults import stored_deployment

OWNER = Owner("chat", "serving", "uid-1")


def desired(replicas: int = 1, **fields: Any) -> dict[str, Any]:
    spec = parse_spec({"model": {"uri": "hf://o/m"}, **fields})
    return with_config_hash(build_deployment(OWNER, spec, default_image="img:1", replicas=replicas))


def as_served(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the API server returns: our fields plus defaults, status and canonical quantities."""
    live = copy.deepcopy(manifest)
    live["metadata"].update(uid="u", resourceVersion="7", generation=1)
    live["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "1"
    live["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] = "t"
    container = live["spec"]["template"]["spec"]["containers"][0]
    container["terminationMessagePath"] = "/dev/termination-log"
    container["startupProbe"]["httpGet"]["scheme"] = "HTTP"
    live["status"] = {"replicas": 1}
    return live


def test_what_the_server_adds_is_not_drift() -> None:
    want = desired(resources={"limits": {"memory": "1024Mi", "cpu": 2}}, gpus=1)
    live = as_served(want)
    limits = live["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    limits.update(memory="1Gi", cpu="2", **{"nvidia.com/gpu": "1"})  # canonical forms
    assert not has_drifted(want, live)


def test_a_hand_edit_of_our_field_is_drift() -> None:
    want = desired()
    live = as_served(want)
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "someone-else:2"
    assert has_drifted(want, live)


def test_a_removed_list_item_is_drift() -> None:
    want = desired(engine={"env": [{"name": "A", "value": "1"}]})
    live = as_served(want)
    live["spec"]["template"]["spec"]["containers"][0]["env"].pop()
    assert has_drifted(want, live)


def test_a_spec_change_is_drift_even_when_it_removes_a_field() -> None:
    # The old Deployment has every field of the new one, but a nodeSelector we no longer want:
    # only the config hash shows it (server-side apply then removes the field).
    old = as_served(desired(nodeSelector={"pool": "a"}))
    new = desired()
    assert is_subset({k: v for k, v in new.items() if k != "metadata"}, old)
    assert has_drifted(new, old)


def engine(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["template"]["spec"]["containers"][0]


def test_stored_fields_are_ours_with_the_values_the_server_stored() -> None:
    want = {"spec": {"off": False, "memory": "1024Mi", "items": [{"x": 1}], "on": True}}
    served = {"spec": {"memory": "1Gi", "items": [{"x": 1, "y": 2}, {"x": 9}], "on": True, "d": 4}}
    # Dropped: ABSENT; defaults the server added inside our items: left out; another manager's
    # item beyond ours: kept whole; fields only the server has: left out.
    assert stored_fields(want, served) == {
        "spec": {"off": ABSENT, "memory": "1Gi", "items": [{"x": 1}, {"x": 9}], "on": True}
    }


def test_a_value_the_server_drops_is_no_drift_against_the_stored_form() -> None:
    # The issue: readOnly: false (a non-PVC model's cache mount) is not stored; compared as
    # sent, the live Deployment looks edited on every resync.
    want = desired(engine={"env": [{"name": "EMPTY", "value": ""}]})
    assert engine(want)["volumeMounts"][0]["readOnly"] is False
    live = stored_deployment(want)
    assert "readOnly" not in engine(live)["volumeMounts"][0]
    assert has_drifted(want, live)
    expected = stored_fields(want, live)
    assert not has_drifted(expected, live)


@pytest.mark.parametrize(
    "edit",
    [
        lambda live: engine(live).update(image="someone-else:2"),
        lambda live: engine(live).update(command=["sh"]),
        lambda live: engine(live)["env"].pop(),
        lambda live: engine(live)["volumeMounts"][0].update(readOnly=True),  # dropped, then set
        lambda live: live["spec"].update(replicas=3),
    ],
    ids=["image", "command", "removed-env", "readOnly-set", "replicas"],
)
def test_a_hand_edit_is_drift_against_the_stored_form(edit: Any) -> None:
    want = desired()
    live = stored_deployment(want)
    expected = stored_fields(want, live)
    edit(live)
    assert has_drifted(expected, live)


def test_another_managers_list_item_is_not_drift() -> None:
    # Server-side apply leaves a sidecar another manager added: re-applying cannot remove it,
    # so it must not count as drift (the dry-run's answer includes it).
    want = desired()
    served = stored_deployment(want)
    served["spec"]["template"]["spec"]["containers"].append({"name": "sidecar", "image": "s:1"})
    assert not has_drifted(stored_fields(want, served), served)
    # A form remembered from before the sidecar came no longer matches: reconcile then asks the
    # server again rather than calling it drift.
    assert has_drifted(stored_fields(want, stored_deployment(want)), served)


def test_missing_object_is_drift() -> None:
    assert has_drifted(desired(), None)


def test_config_hash_ignores_replicas() -> None:
    hash_of = lambda m: m["metadata"]["annotations"]["kvpilot.dev/config-hash"]  # noqa: E731
    assert hash_of(desired(replicas=1)) == hash_of(desired(replicas=5))
    assert hash_of(desired()) != hash_of(desired(engine={"maxNumSeqs": 4}))


def test_subset_semantics() -> None:
    assert is_subset({"a": 1}, {"a": 1, "b": 2})
    assert not is_subset({"a": 1, "b": 2}, {"a": 1})
    assert not is_subset({"a": [1, 2]}, {"a": [1, 2, 3]})
    assert is_subset({"a": [{"x": 1}]}, {"a": [{"x": 1, "y": 0}]})
    assert not is_subset({"a": True}, {"a": 1})  # bool is not int
    assert is_subset({"limits": {"cpu": "500m"}}, {"limits": {"cpu": "0.5"}})
    assert not is_subset({"limits": {"cpu": "500m"}}, {"limits": {"cpu": "1"}})


def test_replicas_for_fixed_size() -> None:
    spec = parse_spec({"model": {"uri": "hf://o/m"}, "replicas": 3})
    assert replicas_for(spec, None) == 3
    assert replicas_for(spec, {"spec": {"replicas": 7}}) == 3  # the spec wins


def test_replicas_for_autoscaling_never_undoes_a_scale() -> None:
    spec = parse_spec(
        {"model": {"uri": "hf://o/m"}, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}
    )
    assert replicas_for(spec, None) == 2  # a new Deployment starts at minReplicas
    assert replicas_for(spec, {"spec": {"replicas": 4}}) == 4  # the autoscaler's count stays
    assert replicas_for(spec, {"spec": {"replicas": 9}}) == 5  # clamped into new bounds
    assert replicas_for(spec, {"spec": {"replicas": 1}}) == 2


def test_controlled_by_checks_the_owner_uid() -> None:
    live = desired()
    assert is_controlled_by(live, "uid-1")
    assert not is_controlled_by(live, "uid-2")
    assert not is_controlled_by({"metadata": {}}, "uid-1")
