"""Table-driven tests of the pure builders: every spec field that reaches a manifest."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvpilot.operator.builders import (
    Owner,
    build_deployment,
    build_service,
    label_selector,
    service_url,
)
from kvpilot.operator.spec import parse_spec

OWNER = Owner(name="chat", namespace="serving", uid="uid-1")
IMAGE = "registry.example/kvpilot:1"
BUILTIN = {"uri": "builtin://smollm2-135m-instruct"}
POD = "spec.template.spec"
ENGINE = f"{POD}.containers[0]"
FETCH = f"{POD}.initContainers[0]"


def at(obj: Any, path: str) -> Any:
    """at(d, "spec.template.spec.containers[0].args") -> that value (KeyError if absent)."""
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        obj = obj[int(part[1:-1])] if part.startswith("[") else obj[part]
    return obj


def deployment(replicas: int = 1, **fields: Any) -> dict[str, Any]:
    spec = parse_spec({"model": BUILTIN, **fields})
    return build_deployment(OWNER, spec, default_image=IMAGE, replicas=replicas)


def args_of(manifest: dict[str, Any]) -> list[str]:
    return at(manifest, f"{ENGINE}.args")


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# (spec fields, path in the Deployment, expected value)
# What the operator sets in every engine container (before the user's env).
ENGINE_ENV = [
    {"name": "HF_HUB_OFFLINE", "value": "1"},
    {"name": "HOME", "value": "/tmp"},
    {"name": "KVPILOT_CACHE_DIR", "value": "/models/.kvpilot-cache"},
    {"name": "TRITON_CACHE_DIR", "value": "/models/.kvpilot-cache/triton"},
]
FIELD_TABLE: list[tuple[dict[str, Any], str, Any]] = [
    ({}, f"{ENGINE}.image", IMAGE),
    ({"engine": {"image": "mine:2"}}, f"{ENGINE}.image", "mine:2"),
    ({"engine": {"imagePullPolicy": "Always"}}, f"{ENGINE}.imagePullPolicy", "Always"),
    (
        {"model": {"uri": "hf://o/m"}, "engine": {"imagePullPolicy": "Never"}},
        f"{FETCH}.imagePullPolicy",
        "Never",
    ),
    ({}, f"{ENGINE}.command", ["kvpilot"]),
    ({"resources": {"limits": {"memory": "4Gi"}}}, f"{ENGINE}.resources.limits.memory", "4Gi"),
    ({"resources": {"requests": {"cpu": 2}}}, f"{ENGINE}.resources.requests.cpu", "2"),
    ({"nodeSelector": {"pool": "a100"}}, f"{POD}.nodeSelector", {"pool": "a100"}),
    (
        {"tolerations": [{"key": "k", "operator": "Exists", "effect": "NoExecute"}]},
        f"{POD}.tolerations",
        [{"key": "k", "operator": "Exists", "effect": "NoExecute"}],
    ),
    (
        {"affinity": {"nodeAffinity": {"x": 1}}},
        f"{POD}.affinity",
        {"nodeAffinity": {"x": 1}},
    ),
    ({"priorityClassName": "high"}, f"{POD}.priorityClassName", "high"),
    ({"serviceAccountName": "engine-sa"}, f"{POD}.serviceAccountName", "engine-sa"),
    ({}, f"{POD}.automountServiceAccountToken", False),
    ({"imagePullSecrets": ["regcred"]}, f"{POD}.imagePullSecrets", [{"name": "regcred"}]),
    ({"podAnnotations": {"team": "ml"}}, "spec.template.metadata.annotations.team", "ml"),
    ({"podLabels": {"team": "ml"}}, "spec.template.metadata.labels.team", "ml"),
    ({"rollout": {"maxSurge": "25%"}}, "spec.strategy.rollingUpdate.maxSurge", "25%"),
    (
        {"rollout": {"maxSurge": 0, "maxUnavailable": 1}},
        "spec.strategy.rollingUpdate",
        {"maxSurge": 0, "maxUnavailable": 1},
    ),
    ({"drainSeconds": 45}, f"{POD}.terminationGracePeriodSeconds", 5 + 45 + 10),
    (
        {"engine": {"startupTimeoutSeconds": 600}},
        f"{ENGINE}.startupProbe.failureThreshold",
        60,
    ),
    ({"engine": {"startupTimeoutSeconds": 600}}, "spec.progressDeadlineSeconds", 900),
    (
        {"engine": {"env": [{"name": "LOG", "value": "debug"}]}},
        f"{ENGINE}.env",
        [*ENGINE_ENV, {"name": "LOG", "value": "debug"}],
    ),
    (
        {"engine": {"env": [{"name": "HF_HUB_OFFLINE", "value": "0"}]}},
        f"{ENGINE}.env",
        [*ENGINE_ENV[1:], {"name": "HF_HUB_OFFLINE", "value": "0"}],
    ),
    (
        {"model": {**BUILTIN, "cache": {"sizeLimit": "20Gi"}}},
        f"{POD}.volumes[0].emptyDir",
        {"sizeLimit": "20Gi"},
    ),
    (
        {"model": {"uri": "hf://o/m", "cache": {"claimName": "hf-cache"}}},
        f"{POD}.volumes[0].persistentVolumeClaim",
        {"claimName": "hf-cache"},
    ),
    (
        {"model": {"uri": "pvc://weights/llama"}},
        f"{POD}.volumes[0].persistentVolumeClaim",
        {"claimName": "weights", "readOnly": True},
    ),
    ({"model": {"uri": "pvc://weights/llama"}}, f"{ENGINE}.volumeMounts[0].readOnly", True),
    (
        {},
        f"{ENGINE}.volumeMounts[0]",
        {"name": "model-cache", "mountPath": "/models", "readOnly": False},
    ),
]


@pytest.mark.parametrize(("fields", "path", "expected"), FIELD_TABLE)
def test_spec_field_reaches_the_deployment(
    fields: dict[str, Any], path: str, expected: Any
) -> None:
    assert at(deployment(**fields), path) == expected


# (spec fields, expected `kvpilot serve` arguments after the fixed head)
ARGS_TABLE: list[tuple[dict[str, Any], list[str]]] = [
    ({}, ["--served-model-name", "chat", "--shutdown-timeout", "300"]),
    (
        {"model": {**BUILTIN, "servedName": "smol"}},
        ["--served-model-name", "smol", "--shutdown-timeout", "300"],
    ),
    (
        {"model": {"uri": "hf://Qwen/Qwen2.5-7B@v1"}},
        ["--model", "/models/hf/Qwen/Qwen2.5-7B/v1", "--served-model-name", "chat"],
    ),
    ({"model": {"uri": "pvc://weights/a/b"}}, ["--model", "/models/a/b", "--served-model-name"]),
    ({"model": {"uri": "file:///opt/m"}}, ["--model", "/opt/m", "--served-model-name"]),
    ({"engine": {"blockSize": 32}}, ["--block-size", "32"]),
    ({"engine": {"maxModelLen": 4096}}, ["--max-model-len", "4096"]),
    ({"engine": {"maxNumSeqs": 64}}, ["--max-num-seqs", "64"]),
    ({"engine": {"maxNumBatchedTokens": 8192}}, ["--max-num-batched-tokens", "8192"]),
    ({"engine": {"dtype": "bfloat16"}}, ["--dtype", "bfloat16"]),
    ({"engine": {"kvCacheDtype": "fp8"}}, ["--kv-cache-dtype", "fp8"]),
    ({"engine": {"gpuMemoryUtilization": 0.85}}, ["--gpu-memory-utilization", "0.85"]),
    ({"engine": {"enablePrefixCaching": False}}, ["--no-enable-prefix-caching"]),
    (
        {"engine": {"structuredOutputsBackend": "xgrammar"}},
        ["--structured-outputs-backend", "xgrammar"],
    ),
    ({"engine": {"toolCallParser": "llama3_json"}}, ["--tool-call-parser", "llama3_json"]),
    ({"engine": {"chatTemplate": "{{ messages }}"}}, ["--chat-template", "{{ messages }}"]),
    ({"drainSeconds": 90}, ["--shutdown-timeout", "90"]),
    ({"engine": {"kvCacheBytes": "768Mi"}}, ["--kv-cache-memory-bytes", str(768 * 2**20)]),
    (
        {"engine": {"kvCacheMemoryFraction": 0.25}, "resources": {"limits": {"memory": "4Gi"}}},
        ["--kv-cache-memory-bytes", str(2**30)],
    ),
]


@pytest.mark.parametrize(("fields", "expected"), ARGS_TABLE)
def test_spec_field_reaches_the_engine_arguments(
    fields: dict[str, Any], expected: list[str]
) -> None:
    args = args_of(deployment(**fields))
    assert args[:5] == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    tail = args[5:]
    start = tail.index(expected[0])
    assert tail[start : start + len(expected)] == expected


def test_builtin_model_gets_no_model_argument_and_no_download() -> None:
    manifest = deployment()
    assert "--model" not in args_of(manifest)
    assert "initContainers" not in at(manifest, POD)


def test_default_arguments_leave_engine_defaults_alone() -> None:
    args = args_of(deployment())
    for name in ("--block-size", "--max-model-len", "--dtype", "--no-enable-prefix-caching"):
        assert name not in args


def test_extra_args_come_last_as_written() -> None:
    args = args_of(deployment(engine={"extraArgs": ["--seed", "7", "--max-queue=64"]}))
    assert args[-3:] == ["--seed", "7", "--max-queue=64"]


def test_hf_model_downloads_in_an_init_container_with_the_token() -> None:
    manifest = deployment(
        model={
            "uri": "hf://meta-llama/Llama-3.1-8B@main",
            "tokenSecret": {"name": "hf", "key": "token"},
            "allowPatterns": ["*.json", "*.gguf"],
        },
        engine={"env": [{"name": "HF_ENDPOINT", "value": "http://mirror"}]},
    )
    fetch = at(manifest, FETCH)
    assert fetch["image"] == IMAGE
    assert fetch["command"] == ["python", "-m", "kvpilot.operator.modelfetch"]
    assert fetch["args"] == [
        "--repo",
        "meta-llama/Llama-3.1-8B",
        "--dest",
        "/models/hf/meta-llama/Llama-3.1-8B/main",
        "--cache-dir",
        "/models/.kvpilot-cache",
        "--revision",
        "main",
        "--allow-pattern",
        "*.json",
        "--allow-pattern",
        "*.gguf",
    ]
    env = {var["name"]: var for var in fetch["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["HF_ENDPOINT"]["value"] == "http://mirror"
    assert "HF_HUB_OFFLINE" not in env  # the download must reach the Hub
    assert fetch["volumeMounts"] == [
        {"name": "model-cache", "mountPath": "/models"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    assert flag(args_of(manifest), "--model") == "/models/hf/meta-llama/Llama-3.1-8B/main"
    # The engine never sees the token.
    assert "HF_TOKEN" not in {var["name"] for var in at(manifest, f"{ENGINE}.env")}


def test_model_fetch_converts_into_the_cache_the_engine_reads() -> None:
    manifest = deployment(model={"uri": "hf://o/m"})
    fetch = at(manifest, FETCH)
    cache_dir = fetch["args"][fetch["args"].index("--cache-dir") + 1]
    engine_env = {var["name"]: var.get("value") for var in at(manifest, f"{ENGINE}.env")}
    assert cache_dir == engine_env["KVPILOT_CACHE_DIR"]
    # The cache lies on the volume the init container writes (shared by the pods on a claim).
    mounts = {m["mountPath"]: m["name"] for m in fetch["volumeMounts"]}
    assert cache_dir.startswith("/models/") and mounts["/models"] == "model-cache"


def test_model_fetch_may_use_the_engines_memory_limit_to_convert() -> None:
    assert at(deployment(model={"uri": "hf://o/m"}), f"{FETCH}.resources.limits.memory") == "4Gi"
    manifest = deployment(model={"uri": "hf://o/m"}, resources={"limits": {"memory": "24Gi"}})
    assert at(manifest, f"{FETCH}.resources.limits.memory") == "24Gi"
    assert at(manifest, f"{FETCH}.resources.requests.memory") == "256Mi"


def test_hf_default_download_patterns_skip_duplicate_weights() -> None:
    fetch = at(deployment(model={"uri": "hf://o/m"}), FETCH)
    patterns = [fetch["args"][i + 1] for i, a in enumerate(fetch["args"]) if a == "--allow-pattern"]
    assert "*.safetensors" in patterns and "*.json" in patterns
    assert not any(p.endswith((".bin", ".pth", ".pt")) for p in patterns)


def test_gpus_request_the_device_and_tolerate_its_taint() -> None:
    manifest = deployment(gpus=1, tolerations=[{"key": "spot", "operator": "Exists"}])
    assert at(manifest, f"{ENGINE}.resources.limits") == {"nvidia.com/gpu": "1"}
    assert at(manifest, f"{POD}.tolerations") == [
        {"key": "spot", "operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    user_own = deployment(gpus=1, tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}])
    assert len(at(user_own, f"{POD}.tolerations")) == 1
    assert "tolerations" not in at(deployment(), POD)


def test_probes_follow_the_engine_contract() -> None:
    engine = at(deployment(), ENGINE)
    assert engine["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert engine["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert engine["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    budget = engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"]
    assert budget >= 1800  # half an hour for a big model to load
    assert engine["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert engine["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert engine["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_grace_period_covers_prestop_and_drain() -> None:
    for drain in (0, 30, 600):
        manifest = deployment(drainSeconds=drain)
        prestop = int(at(manifest, f"{ENGINE}.lifecycle.preStop.exec.command")[1])
        assert at(manifest, f"{POD}.terminationGracePeriodSeconds") > prestop + drain


def test_metadata_labels_selector_owner_and_scrape_annotations() -> None:
    manifest = deployment(replicas=3, podLabels={"team": "ml"})
    assert manifest["metadata"]["name"] == "chat" and manifest["metadata"]["namespace"] == "serving"
    assert manifest["spec"]["replicas"] == 3
    selector = {"app.kubernetes.io/name": "kvpilot-engine", "app.kubernetes.io/instance": "chat"}
    assert manifest["spec"]["selector"] == {"matchLabels": selector}
    pod_labels = at(manifest, "spec.template.metadata.labels")
    assert selector.items() <= pod_labels.items() and pod_labels["team"] == "ml"
    assert manifest["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvpilot-operator"
    assert manifest["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "kvpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "chat",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    annotations = at(manifest, "spec.template.metadata.annotations")
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert (
        label_selector("chat")
        == "app.kubernetes.io/name=kvpilot-engine,app.kubernetes.io/instance=chat"
    )


def test_pods_run_under_the_restricted_security_profile() -> None:
    pod = at(deployment(model={"uri": "hf://o/m"}), POD)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"] + pod["initContainers"]:
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        # With a read-only root, every write goes to a volume: /tmp (HOME) and the model cache.
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert "/tmp" in mounts and mounts["/models"].get("readOnly") is not True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}
    assert pod["securityContext"]["runAsUser"] != 0


@pytest.mark.parametrize(
    ("model", "cache_dir"),
    [
        ({"uri": "builtin://smollm2-135m-instruct"}, "/models/.kvpilot-cache"),
        ({"uri": "hf://o/m", "cache": {"claimName": "shared"}}, "/models/.kvpilot-cache"),
        ({"uri": "pvc://weights/llama"}, "/tmp/kvpilot-cache"),  # /models is read-only there
    ],
)
def test_the_engine_writes_its_cache_to_a_writable_volume(
    model: dict[str, Any], cache_dir: str
) -> None:
    container = at(deployment(model=model), ENGINE)
    env = {var["name"]: var.get("value") for var in container["env"]}
    assert env["KVPILOT_CACHE_DIR"] == cache_dir and env["HOME"] == "/tmp"
    mount = next(m for m in container["volumeMounts"] if cache_dir.startswith(m["mountPath"]))
    assert mount.get("readOnly") is not True


def test_the_api_key_comes_from_the_secret_never_the_arguments() -> None:
    manifest = deployment(engine={"apiKeySecret": {"name": "keys", "key": "chat"}})
    container = at(manifest, ENGINE)
    env = {var["name"]: var for var in container["env"]}
    assert env["KVPILOT_API_KEY"] == {
        "name": "KVPILOT_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "keys", "key": "chat"}},
    }
    assert not any("api-key" in arg for arg in container["args"])
    default_key = deployment(engine={"apiKeySecret": {"name": "keys"}})
    ref = {v["name"]: v for v in at(default_key, ENGINE)["env"]}["KVPILOT_API_KEY"]
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}


@pytest.mark.parametrize("drain", [0, 10, 300, 3600])
def test_the_grace_period_covers_prestop_drain_and_a_margin(drain: int) -> None:
    pod = at(deployment(drainSeconds=drain), POD)
    container = pod["containers"][0]
    prestop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert flag(container["args"], "--shutdown-timeout") == str(drain)
    assert pod["terminationGracePeriodSeconds"] >= prestop + drain + 10
    default = at(deployment(), POD)
    assert default["terminationGracePeriodSeconds"] >= 5 + 300 + 10  # long generations drain


def test_service_exposes_port_8000_named_http_to_the_engine_pods() -> None:
    service = build_service(OWNER)
    assert service["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert service["spec"]["selector"] == at(deployment(), "spec.selector.matchLabels")
    assert service["spec"]["ports"] == [
        {
            "name": "http",
            "port": 8000,
            "targetPort": "http",
            "protocol": "TCP",
            "appProtocol": "http",
        }
    ]
    assert service_url(OWNER) == "http://chat.serving.svc:8000/v1"


def test_builders_are_pure() -> None:
    spec = parse_spec({"model": {"uri": "hf://o/m"}, "gpus": 1})
    first = build_deployment(OWNER, spec, default_image=IMAGE, replicas=2)
    second = build_deployment(OWNER, spec, default_image=IMAGE, replicas=2)
    assert first == second
    first["spec"]["template"]["spec"]["containers"][0]["args"].append("mutated")
    assert build_deployment(OWNER, spec, default_image=IMAGE, replicas=2) == second
