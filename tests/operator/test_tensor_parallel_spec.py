"""Tensor parallelism in the InferenceService: gpus sets the size by default, engine.
tensorParallelSize overrides it (no more than gpus: CEL and the model agree), a size the builtin
model cannot split is refused with the sizes it takes, and the pod gets the flag, a memory-backed
/dev/shm and a status that shows the size."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from kvpilot.contract.sizing import tensor_parallel_sizes
from kvpilot.operator.builders import Owner, build_deployment
from kvpilot.operator.crdgen import build_crd
from kvpilot.operator.spec import InvalidSpecError, parse_spec
from kvpilot.operator.status import Observed, build_status

from .crd_schema import api_server_errors

OWNER = Owner(name="chat", namespace="serving", uid="uid-1")
HF = {"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"}
BUILTIN = {"uri": "builtin://smollm2-135m-instruct"}


def pod_of(**spec: Any) -> dict[str, Any]:
    deployment = build_deployment(OWNER, parse_spec(spec), default_image="img:1", replicas=1)
    return deployment["spec"]["template"]["spec"]


def tp_flag(pod: dict[str, Any]) -> str | None:
    args = pod["containers"][0]["args"]
    flag = "--tensor-parallel-size"
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize(
    ("spec", "size"),
    [
        ({"model": HF, "gpus": 4}, "4"),  # gpus sets the size
        ({"model": HF, "gpus": 4, "engine": {"tensorParallelSize": 2}}, "2"),
        ({"model": HF, "gpus": 4, "engine": {"tensorParallelSize": 1}}, None),
        ({"model": HF, "gpus": 1}, None),
        ({"model": HF, "engine": {"tensorParallelSize": 2}}, "2"),  # CPU ranks share the cores
        ({"model": BUILTIN, "gpus": 3}, "3"),
        ({"model": BUILTIN}, None),
    ],
)
def test_the_size_reaches_the_engine_with_a_memory_backed_shm(
    spec: dict[str, Any], size: str | None
) -> None:
    pod = pod_of(**spec)
    assert tp_flag(pod) == size
    shm = [v for v in pod["volumes"] if v["name"] == "dshm"]
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "dshm"]
    if size is None:
        assert shm == [] and mounts == []
    else:
        assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        assert mounts == [{"name": "dshm", "mountPath": "/dev/shm"}]


def test_more_ranks_than_gpus_is_refused_by_cel_and_by_the_model() -> None:
    spec = {"model": HF, "gpus": 2, "engine": {"tensorParallelSize": 4}}
    obj = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "serving"},
        "spec": spec,
    }
    errors = api_server_errors(build_crd(), obj)
    assert any("tensorParallelSize cannot exceed spec.gpus" in e for e in errors), errors
    with pytest.raises(InvalidSpecError, match=r"engine\.tensorParallelSize 4 exceeds gpus 2"):
        parse_spec(spec)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"model": BUILTIN, "gpus": 2}, "tensor-parallel size 2 from gpus (the default size)"),
        ({"model": BUILTIN, "engine": {"tensorParallelSize": 9}}, "from engine.tensorParallelSize"),
    ],
)
def test_a_size_the_builtin_model_cannot_split_names_the_sizes_it_takes(
    spec: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidSpecError) as error:
        parse_spec(spec)
    assert message in str(error.value)
    assert "(9 attention heads, 3 KV heads): it takes [1, 3]" in str(error.value)


def test_sizes_divide_heads_and_mlp_and_split_or_replicate_kv_heads() -> None:
    assert tensor_parallel_sizes(9, 3, 1536) == [1, 3]  # 9 would not divide the MLP's 1536
    assert tensor_parallel_sizes(64, 8, 28672) == [1, 2, 4, 8, 16, 32, 64]  # Llama-3.1-70B
    assert tensor_parallel_sizes(6, 4, 96) == [1, 2]  # 3 and 6 split neither way


def test_status_shows_the_size() -> None:
    observed = Observed(
        generation=1, deployment=None, pods=[], desired_replicas=1, selector="s", url="u",
        model="chat", tensor_parallel_size=4,
    )  # fmt: skip
    assert build_status({}, observed, datetime.datetime(2026, 1, 1))["tensorParallelSize"] == 4
