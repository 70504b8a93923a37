"""The InferenceService spec as pydantic models: the single source of truth for the CRD schema.

crdgen.py turns these models into crds/*.yaml; reconcile validates every object through
`parse_spec`, so a spec the API server let through (an old CRD, a rule CEL cannot express) still
meets one definition. Field descriptions are what `kubectl explain` shows.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from kubernetes.utils import parse_quantity
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from kvpilot.contract.engine_choices import KV_CACHE_DTYPES
from kvpilot.contract.kube import LABEL_INSTANCE, LABEL_NAME
from kvpilot.contract.kube_model import InvalidSpecError, format_validation_error
from kvpilot.contract.lora import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    MAX_LORA_RANK_LIMIT,
    NAME_MAX_LENGTH,
    TARGET_MODULES,
    name_problem,
)
from kvpilot.contract.lora import NAME_PATTERN as ADAPTER_NAME_PATTERN
from kvpilot.contract.sizing import tensor_parallel_sizes
from kvpilot.operator.autoscaling.spec import AutoscalingSpec
from kvpilot.operator.builtin_models import BUILTIN_MODELS
from kvpilot.operator.constants import NVIDIA_GPU
from kvpilot.operator.extraargs import check_api_cpus, check_extra_args, check_placement
from kvpilot.operator.kubetypes import (
    EnvVar,
    FreeForm,
    IntOrPercent,
    KubeModel,
    Quantity,
    ResourceRequirements,
    SecretKeyRef,
    Toleration,
)
from kvpilot.operator.modeluri import (
    ADAPTER_URI_PATTERN,
    URI_PATTERN,
    BuiltinModel,
    FileModel,
    HfModel,
    ModelSource,
    PvcModel,
    parse_adapter_uri,
    parse_model_uri,
)

# A namespace's name: a DNS-1123 label.
NAMESPACE_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# metadata.name names the Service too, so it must be a DNS-1035 label.
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_NAME_LENGTH = 63
RESERVED_LABELS = (LABEL_NAME, LABEL_INSTANCE)
# Set by the operator from engine.apiKeySecret; user env may not shadow it.
API_KEY_ENV = "KVPILOT_API_KEY"
MIN_KV_CACHE_BYTES = 2**20
DEFAULT_DRAIN_SECONDS = 300
# contract.lora.TARGET_MODULES as a type: the CRD's enum, so kubectl refuses any other target.
TargetModule = Literal[TARGET_MODULES]  # type: ignore[valid-type]
# Bounds the CEL rules' cost over spec.adapters (the API server refuses unbounded loops).
MAX_ADAPTERS = 256
# Shared prefixes are matched against every prompt of every tenant: few, and each a prompt's size.
MAX_SHARED_PREFIXES = 16
MAX_SHARED_PREFIX_CHARS = 65536


class ModelCache(KubeModel):
    """The model-cache volume mounted at /models (an emptyDir unless a claim is named)."""

    size_limit: Quantity | None = Field(
        default=None, description="Size limit of the emptyDir cache, e.g. 40Gi."
    )
    claim_name: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description=(
            "A PersistentVolumeClaim to use as the cache instead of an emptyDir, so hf:// "
            "downloads survive pod restarts (ReadWriteMany when replicas share it)."
        ),
    )


class ModelSpec(KubeModel):
    """Which model the engine serves."""

    uri: Annotated[str, WithJsonSchema({"type": "string", "pattern": URI_PATTERN})] = Field(
        description=(
            "Where the weights come from: hf://org/name[@revision] (downloaded by an init "
            "container), pvc://claim/path (a PersistentVolumeClaim mounted read-only), "
            "file:///path (inside the image) or "
            f"{' or '.join(f'builtin://{name}' for name in BUILTIN_MODELS)} (bundled with the "
            "engine, runs on CPU)."
        )
    )
    served_name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$",
        description=(
            "The model name clients put in OpenAI requests. Defaults to the InferenceService's "
            "name."
        ),
    )
    token_secret: SecretKeyRef | None = Field(
        default=None,
        description="Hugging Face token for gated or private hf:// models (set as HF_TOKEN).",
    )
    allow_patterns: list[str] | None = Field(
        default=None,
        min_length=1,
        description=(
            "hf:// only: glob patterns of the repo files to download. Defaults to config, "
            "tokenizer and safetensors files (*.json, *.safetensors, *.model, *.txt, "
            "*.tiktoken, *.jinja); set e.g. ['*.json', '*Q8_0.gguf'] for a GGUF repo."
        ),
    )
    cache: ModelCache | None = Field(default=None, description=ModelCache.__doc__)

    @field_validator("uri")
    @classmethod
    def _valid_uri(cls, uri: str) -> str:
        parse_model_uri(uri)
        return uri

    @model_validator(mode="after")
    def _coherent(self) -> ModelSpec:
        scheme = self.uri.partition("://")[0]
        if self.token_secret is not None and scheme != "hf":
            raise ValueError("tokenSecret is only used with hf:// models")
        if self.allow_patterns is not None and scheme != "hf":
            raise ValueError("allowPatterns is only used with hf:// models")
        if self.cache is not None and self.cache.claim_name is not None and scheme == "pvc":
            raise ValueError("cache.claimName cannot be set with a pvc:// model (the claim is it)")
        return self

    @property
    def source(self) -> ModelSource:
        return parse_model_uri(self.uri)


class ApiKeySecret(KubeModel):
    """A key of a Secret in the InferenceService's namespace that holds the engine's API key."""

    name: str = Field(min_length=1, max_length=253, description="Name of the Secret.")
    key: str = Field(
        default="api-key", min_length=1, description="Key in the Secret that holds the API key."
    )


class LoraSpec(KubeModel):
    """The engine's LoRA limits. Present (or any spec.adapters), the engine starts with LoRA
    and runtime adapter loading on; adapters then come and go without restarting a pod."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.maxCpuLoras) || self.maxCpuLoras >= "
                    f"(has(self.maxLoras) ? self.maxLoras : {DEFAULT_MAX_LORAS})",
                    "message": "engine.lora.maxCpuLoras cannot be below maxLoras: an adapter "
                    "in a batch is also kept in host memory",
                }
            ]
        }
    )

    max_loras: int = Field(
        default=DEFAULT_MAX_LORAS,
        ge=1,
        le=MAX_ADAPTERS,
        description="Adapters one batch may use at once, each in a GPU (or CPU) slot "
        f"(--max-loras). Default: {DEFAULT_MAX_LORAS}.",
    )
    max_lora_rank: int = Field(
        default=DEFAULT_MAX_LORA_RANK,
        ge=1,
        le=MAX_LORA_RANK_LIMIT,
        description="Highest rank an adapter may have (--max-lora-rank); the slots are sized "
        f"by it. Default: {DEFAULT_MAX_LORA_RANK}.",
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ADAPTERS,
        description="Adapters kept in host memory, least recently used evicted first "
        "(--max-cpu-loras). Default: maxLoras.",
    )

    @model_validator(mode="after")
    def _cpu_holds_the_slots(self) -> LoraSpec:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"engine.lora.maxCpuLoras {self.max_cpu_loras} cannot be below maxLoras "
                f"{self.max_loras}: an adapter in a batch is also kept in host memory"
            )
        return self

    @property
    def effective_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


class AdapterSpec(KubeModel):
    """A LoRA adapter (PEFT format) served on top of the model: requests name it as `model`.
    Added or removed, it is loaded or unloaded in the running replicas, with no restart."""

    name: Annotated[
        str,
        WithJsonSchema(
            {"type": "string", "pattern": ADAPTER_NAME_PATTERN, "maxLength": NAME_MAX_LENGTH}
        ),
    ] = Field(
        description="The `model` clients ask for: letters, digits, '.', '_' and '-', starting "
        f"and ending with a letter or digit, at most {NAME_MAX_LENGTH} characters; not the "
        "served model's name.",
    )
    uri: Annotated[str, WithJsonSchema({"type": "string", "pattern": ADAPTER_URI_PATTERN})] = Field(
        description="Where the adapter comes from: hf://org/name[@revision] (the engine "
        "downloads it when it loads it), pvc://claim/path (the claim must be the model "
        "cache's: spec.model.cache.claimName, or the pvc:// model's own claim) or "
        "file:///path (inside the image)."
    )
    rank: int | None = Field(
        default=None,
        ge=1,
        le=MAX_LORA_RANK_LIMIT,
        description="The adapter's rank (r), when known: refused above "
        "engine.lora.maxLoraRank before any pod sees it.",
    )
    target_modules: list[TargetModule] | None = Field(
        default=None,
        min_length=1,
        max_length=len(TARGET_MODULES),
        description="The layers the adapter changes, when known: any of "
        f"{', '.join(TARGET_MODULES)}.",
    )

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str) -> str:
        problem = name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        return name

    @field_validator("uri")
    @classmethod
    def _valid_uri(cls, uri: str) -> str:
        parse_adapter_uri(uri)
        return uri

    @property
    def source(self) -> HfModel | PvcModel | FileModel:
        return parse_adapter_uri(self.uri)


class EngineSpec(KubeModel):
    """The engine container: image and `kvpilot serve` options."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.kvCacheBytes) && has(self.kvCacheMemoryFraction))",
                    "message": "engine.kvCacheBytes and engine.kvCacheMemoryFraction are "
                    "mutually exclusive",
                }
            ]
        }
    )

    image: str | None = Field(
        default=None,
        min_length=1,
        description="Engine image. Defaults to the operator's default engine image.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Image pull policy of the engine and model-fetch containers."
    )
    block_size: Literal[8, 16, 32, 64, 128] | None = Field(
        default=None,
        description="Tokens per KV-cache block (--block-size): 8, 16, 32, 64 or 128.",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="Longest prompt plus completion, in tokens (--max-model-len).",
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Most sequences in one batch (--max-num-seqs)."
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most tokens scheduled in one step (--max-num-batched-tokens).",
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="Reuse KV-cache blocks of shared prompt prefixes (false adds "
        "--no-enable-prefix-caching).",
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] | None = Field(
        default=None, description="Weights and activations dtype (--dtype)."
    )
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="KV-cache element type (--kv-cache-dtype): auto (the model's dtype), fp8 "
        "(= fp8_e4m3) or fp8_e5m2. FP8 holds twice the tokens in the same kvCacheBytes.",
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Fraction of GPU memory the engine may use (--gpu-memory-utilization).",
    )
    kv_cache_bytes: Quantity | None = Field(
        default=None,
        description=(
            "KV-cache budget in bytes on CPU or GPU, e.g. 768Mi (--kv-cache-memory-bytes). "
            "Default: 1Gi on CPU; on GPU what gpuMemoryUtilization leaves. At least 1Mi."
        ),
    )
    kv_cache_memory_fraction: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description=(
            "KV-cache budget as a fraction of resources.limits.memory (which must be set); "
            "exclusive with kvCacheBytes."
        ),
    )
    api_key_secret: ApiKeySecret | None = Field(
        default=None,
        description=(
            "A Secret key holding the API key clients must send as `Authorization: Bearer "
            "KEY`; it reaches the engine as $KVPILOT_API_KEY, never as an argument."
        ),
    )
    tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Split the model over this many GPUs of one pod (--tensor-parallel-size). "
        "Default: spec.gpus when above 1. It must divide the model's attention heads and not "
        "exceed spec.gpus.",
    )
    structured_outputs_backend: Literal["auto", "xgrammar", "llguidance"] | None = Field(
        default=None,
        description="Grammar library for response_format, structured outputs and forced tool "
        "calls (--structured-outputs-backend).",
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = Field(
        default=None,
        description="Tool-call format to parse (--tool-call-parser); by default the one the "
        "model's chat template speaks.",
    )
    chat_template: str | None = Field(
        default=None,
        min_length=1,
        description="A Jinja chat template to use instead of the model's (--chat-template).",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More `kvpilot serve` arguments, appended as written.",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        description="Environment of the engine container and the model download.",
    )
    lora: LoraSpec | None = Field(default=None, description=LoraSpec.__doc__)
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="priority",
        description="How each replica admits waiting requests (--scheduling-policy): "
        "`priority` serves a request's priority first (the router forwards its tenant's "
        "priority class) and, under KV-cache pressure, preempts the lowest first; with equal "
        "priorities it is first-come-first-served, as `fcfs` always is. Default: priority.",
    )
    startup_timeout_seconds: int = Field(
        default=1800,
        ge=10,
        le=86400,
        description=(
            "How long the engine may take to load before the kubelet restarts it (the "
            "startupProbe's budget): large models read from slow storage need minutes."
        ),
    )

    @field_validator("extra_args")
    @classmethod
    def _engine_reads_them(cls, args: list[str]) -> list[str]:
        check_extra_args(args)
        return args

    @field_validator("kv_cache_bytes")
    @classmethod
    def _at_least_a_block(cls, value: int | str | None) -> int | str | None:
        if value is not None and parse_quantity(value) < MIN_KV_CACHE_BYTES:
            raise ValueError(
                f"kvCacheBytes {value} is below 1Mi: too small for one KV block of any model"
            )
        return value

    @model_validator(mode="after")
    def _one_kv_budget(self) -> EngineSpec:
        if self.kv_cache_bytes is not None and self.kv_cache_memory_fraction is not None:
            raise ValueError(
                "engine.kvCacheBytes and engine.kvCacheMemoryFraction are mutually exclusive"
            )
        return self

    @field_validator("env")
    @classmethod
    def _unique_env(cls, env: list[EnvVar]) -> list[EnvVar]:
        names = [var.name for var in env]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"env names must be unique, repeated: {', '.join(duplicates)}")
        return env


class RolloutSpec(KubeModel):
    """How a spec change replaces engine pods (the Deployment's RollingUpdate)."""

    max_surge: IntOrPercent = Field(
        default=1,
        description="Extra pods during a rollout (needs spare GPUs). Default: 1.",
    )
    max_unavailable: IntOrPercent = Field(
        default=0,
        description="Pods that may be down during a rollout; set 1 (with maxSurge 0) where "
        "there is no spare GPU. Default: 0.",
    )

    @model_validator(mode="after")
    def _not_both_zero(self) -> RolloutSpec:
        if self.max_surge in (0, "0%") and self.max_unavailable in (0, "0%"):
            raise ValueError("rollout.maxSurge and rollout.maxUnavailable cannot both be 0")
        return self


class NetworkPolicySpec(KubeModel):
    """A NetworkPolicy that admits to the engine port only kvpilot's own pods (the operator's
    autoscaler, the router: any pod labelled app.kubernetes.io/part-of=kvpilot) and the pods
    of the namespaces listed."""

    allow_namespaces: list[Annotated[str, Field(pattern=NAMESPACE_PATTERN, max_length=63)]] = Field(
        default_factory=list,
        description="Namespaces whose pods may call the engines (your clients, Prometheus).",
    )


class InferenceServiceSpec(KubeModel):
    """An OpenAI-compatible endpoint serving one model with kvpilot's engine."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.replicas) && has(self.autoscaling))",
                    "message": "spec.replicas and spec.autoscaling are mutually exclusive: set "
                    "replicas for a fixed size, or autoscaling to let the operator scale",
                },
                {
                    "rule": "!(has(self.engine) && has(self.engine.dtype) && "
                    "self.engine.dtype == 'float16') || (has(self.gpus) && self.gpus > 0)",
                    "message": "engine.dtype float16 needs a GPU (gpus > 0): on CPU use float32 "
                    "or bfloat16",
                },
                {
                    "rule": "!(has(self.engine) && has(self.engine.kvCacheMemoryFraction)) || "
                    "(has(self.resources) && has(self.resources.limits) && "
                    "'memory' in self.resources.limits)",
                    "message": "engine.kvCacheMemoryFraction needs resources.limits.memory",
                },
                {
                    "rule": "!has(self.engine) || !has(self.engine.tensorParallelSize) || "
                    "!has(self.gpus) || self.gpus == 0 || "
                    "self.engine.tensorParallelSize <= self.gpus",
                    "message": "spec.engine.tensorParallelSize cannot exceed spec.gpus: each "
                    "rank needs a GPU of its own",
                },
                {
                    "rule": "!has(self.adapters) || self.adapters.all(a, !has(a.rank) || "
                    "a.rank <= (has(self.engine) && has(self.engine.lora) && "
                    "has(self.engine.lora.maxLoraRank) ? self.engine.lora.maxLoraRank : "
                    f"{DEFAULT_MAX_LORA_RANK}))",
                    "message": "an adapter's rank exceeds spec.engine.lora.maxLoraRank "
                    f"(default {DEFAULT_MAX_LORA_RANK}): raise the limit or use another adapter",
                },
            ]
        }
    )

    model: ModelSpec = Field(description=ModelSpec.__doc__)
    engine: EngineSpec = Field(default_factory=EngineSpec, description=EngineSpec.__doc__)
    resources: ResourceRequirements | None = Field(
        default=None, description=ResourceRequirements.__doc__
    )
    gpus: int = Field(
        default=0,
        ge=0,
        le=64,
        description=f"GPUs per replica: requested as {NVIDIA_GPU} (and the matching taint is "
        "tolerated).",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the engine pods must match."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations of the engine pods."
    )
    affinity: FreeForm | None = Field(
        default=None, description="Affinity of the engine pods (as in a Pod)."
    )
    priority_class_name: str | None = Field(
        default=None, description="PriorityClass of the engine pods."
    )
    service_account_name: str | None = Field(
        default=None, description="ServiceAccount the engine pods run as."
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Names of Secrets to pull the engine image with."
    )
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, description="Extra annotations on the engine pods."
    )
    pod_labels: dict[str, str] = Field(
        default_factory=dict, description="Extra labels on the engine pods."
    )
    runtime_class_name: str | None = Field(
        default=None, description="RuntimeClass of the engine pods (e.g. nvidia)."
    )
    topology_spread_constraints: list[FreeForm] | None = Field(
        default=None,
        description="Topology spread of the engine pods (as in a Pod). Default: spread across "
        "nodes and zones where possible (ScheduleAnyway); [] for none.",
    )
    network_policy: NetworkPolicySpec | None = Field(
        default=None, description=NetworkPolicySpec.__doc__
    )
    replicas: int | None = Field(
        default=None,
        ge=0,
        description="Fixed number of engine pods (exclusive with autoscaling). Default: 1.",
    )
    autoscaling: AutoscalingSpec | None = Field(default=None, description=AutoscalingSpec.__doc__)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description=RolloutSpec.__doc__)
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
        description="LoRA adapters served on top of the model, each under its own name. "
        "Adding or removing one loads or unloads it in the running replicas (no rollout); "
        "status.adapters says where each is loaded.",
    )
    shared_prefixes: list[
        Annotated[str, Field(min_length=1, max_length=MAX_SHARED_PREFIX_CHARS)]
    ] = Field(
        default_factory=list,
        max_length=MAX_SHARED_PREFIXES,
        description="Texts the platform shares across tenants, such as a common system "
        "prompt: the router leaves the KV blocks of a prompt that starts with one of them "
        "unsalted, so every tenant hits the same cached prefix (the rest of each prompt "
        "stays cached per tenant).",
    )
    drain_seconds: int = Field(
        default=DEFAULT_DRAIN_SECONDS,
        ge=0,
        le=3600,
        description="On shutdown, how long the engine finishes in-flight requests "
        "(--shutdown-timeout). The pod's terminationGracePeriodSeconds is preStop (5) + this + "
        "a margin (10). Default: 300, room for a long generation on CPU (4096 tokens at "
        "~15 tokens/s); a drain ends as soon as the last request is done.",
    )

    @model_validator(mode="after")
    def _coherent(self) -> InferenceServiceSpec:
        if self.replicas is not None and self.autoscaling is not None:
            raise ValueError(
                "spec.replicas and spec.autoscaling are mutually exclusive: set replicas for a "
                "fixed size, or autoscaling to let the operator scale"
            )
        if self.resources is not None and self.gpus:
            for kind in ("limits", "requests"):
                given = getattr(self.resources, kind).get(NVIDIA_GPU)
                if given is not None and parse_quantity(given) != self.gpus:
                    raise ValueError(
                        f"resources.{kind}[{NVIDIA_GPU}] = {given} contradicts gpus = "
                        f"{self.gpus}: set only gpus"
                    )
        if self.engine.dtype == "float16" and not self.gpus:
            raise ValueError(
                "engine.dtype float16 needs a GPU (gpus > 0): on CPU use float32 or bfloat16"
            )
        if self.engine.kv_cache_memory_fraction is not None:
            if self.memory_limit is None:
                raise ValueError("engine.kvCacheMemoryFraction needs resources.limits.memory")
            if (self.kv_cache_bytes or 0) < MIN_KV_CACHE_BYTES:
                raise ValueError(
                    f"engine.kvCacheMemoryFraction {self.engine.kv_cache_memory_fraction} of "
                    f"the memory limit is below 1Mi: too small for one KV block of any model"
                )
        if self.engine.api_key_secret is not None and any(
            var.name == API_KEY_ENV for var in self.engine.env
        ):
            raise ValueError(
                f"engine.env may not set {API_KEY_ENV} together with engine.apiKeySecret"
            )
        check_tensor_parallel_size(self)
        check_adapters(self)
        check_placement(
            self.engine.extra_args,
            gpus=self.gpus,
            dtype=self.engine.dtype,
            tensor_parallel_size=self.effective_tensor_parallel_size,
        )
        check_api_cpus(self.engine.extra_args, self.cpu_limit)
        reserved = sorted(set(self.pod_labels) & set(RESERVED_LABELS))
        if reserved:
            raise ValueError(
                f"podLabels may not set {', '.join(reserved)}: the operator selects its pods "
                "by them"
            )
        return self

    @property
    def memory_limit(self) -> int | None:
        """resources.limits.memory in bytes (None when not set)."""
        given = None if self.resources is None else self.resources.limits.get("memory")
        return None if given is None else int(parse_quantity(given))

    @property
    def cpu_limit(self) -> float | None:
        """resources.limits.cpu in CPUs (None when not set)."""
        given = None if self.resources is None else self.resources.limits.get("cpu")
        return None if given is None else float(parse_quantity(given))

    @property
    def memory_request(self) -> int | None:
        given = None if self.resources is None else self.resources.requests.get("memory")
        return None if given is None else int(parse_quantity(given))

    @property
    def kv_cache_bytes(self) -> int | None:
        """The engine's KV budget in bytes, when the spec sets one (either way)."""
        engine = self.engine
        if engine.kv_cache_bytes is not None:
            return int(parse_quantity(engine.kv_cache_bytes))
        if engine.kv_cache_memory_fraction is not None and self.memory_limit is not None:
            return int(engine.kv_cache_memory_fraction * self.memory_limit)
        return None

    @property
    def effective_tensor_parallel_size(self) -> int:
        """engine.tensorParallelSize, else every GPU of the pod (1 without GPUs)."""
        size = self.engine.tensor_parallel_size
        return size if size is not None else max(1, self.gpus)

    @property
    def is_lora_enabled(self) -> bool:
        """Whether the engine starts with LoRA on: engine.lora set, or any adapter. The pod
        depends on this and the limits only, never on which adapters there are."""
        return self.engine.lora is not None or bool(self.adapters)

    @property
    def lora_limits(self) -> LoraSpec:
        return self.engine.lora or LoraSpec()

    @property
    def model_cache_claim(self) -> str | None:
        """The PersistentVolumeClaim mounted at the model cache, if one is."""
        source = self.model.source
        if isinstance(source, PvcModel):
            return source.claim
        cache = self.model.cache
        return None if cache is None else cache.claim_name

    @property
    def effective_replicas(self) -> int:
        """The replica count of a fixed-size service (1 when neither field is set)."""
        return 1 if self.replicas is None else self.replicas


def check_tensor_parallel_size(spec: InferenceServiceSpec) -> None:
    """ValueError, with the numbers, for a tensor-parallel size the pod or a known model cannot
    take (the engine checks every model again, before it starts any rank)."""
    given, size = spec.engine.tensor_parallel_size, spec.effective_tensor_parallel_size
    if given is not None and spec.gpus and given > spec.gpus:
        raise ValueError(
            f"engine.tensorParallelSize {given} exceeds gpus {spec.gpus}: each rank needs a GPU "
            "of its own"
        )
    model = spec.model.source
    if not isinstance(model, BuiltinModel):
        return
    shape = BUILTIN_MODELS[model.name]
    allowed = tensor_parallel_sizes(shape.num_heads, shape.num_kv_heads, shape.intermediate_size)
    if size not in allowed:
        source = "engine.tensorParallelSize" if given is not None else "gpus (the default size)"
        raise ValueError(
            f"tensor-parallel size {size} from {source} does not split {spec.model.uri} "
            f"({shape.num_heads} attention heads, {shape.num_kv_heads} KV heads): it takes "
            f"{allowed}; set engine.tensorParallelSize"
        )


def check_adapters(spec: InferenceServiceSpec) -> None:
    """ValueError for adapters no engine of this spec could load: a repeated name, a rank above
    engine.lora.maxLoraRank, a pvc:// claim the pod does not mount."""
    names = [adapter.name for adapter in spec.adapters]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"adapters: names must be unique, repeated: {', '.join(repeated)}")
    limit = spec.lora_limits.max_lora_rank
    claim = spec.model_cache_claim
    for adapter in spec.adapters:
        if adapter.rank is not None and adapter.rank > limit:
            raise ValueError(
                f"adapter {adapter.name!r} has rank {adapter.rank}, above "
                f"engine.lora.maxLoraRank {limit}: raise the limit or use another adapter"
            )
        source = adapter.source
        if isinstance(source, PvcModel) and source.claim != claim:
            mounted = (
                f"the model cache mounts the claim {claim!r}"
                if claim is not None
                else "no claim is mounted (set spec.model.cache.claimName)"
            )
            raise ValueError(
                f"adapter {adapter.name!r}: {adapter.uri} is on the claim {source.claim!r}, "
                f"but {mounted}: adapters on a claim must be on the model cache's, so that "
                "adding one never changes the pods"
            )


def check_adapter_names(spec: InferenceServiceSpec, served_name: str) -> None:
    """InvalidSpecError for an adapter named like the served model (a request's `model`
    could not tell them apart)."""
    for adapter in spec.adapters:
        if adapter.name == served_name:
            raise InvalidSpecError(
                f"spec.adapters: adapter {adapter.name!r} has the served model's name: "
                "requests could not tell them apart; rename the adapter"
            )


def validate_name(name: str) -> None:
    """metadata.name becomes the Service's name, which must be a DNS-1035 label."""
    if len(name) > MAX_NAME_LENGTH or not re.fullmatch(NAME_PATTERN, name):
        raise InvalidSpecError(
            f"metadata.name {name!r} must be a DNS-1035 label (lowercase letters, digits and "
            f"'-', starting with a letter, at most {MAX_NAME_LENGTH} characters): it names the "
            "Service"
        )


def parse_spec(spec: Any) -> InferenceServiceSpec:
    """Validates a raw spec; raises InvalidSpecError with one readable line per problem."""
    if not isinstance(spec, dict):
        raise InvalidSpecError("spec is missing or not an object")
    try:
        return InferenceServiceSpec.model_validate(spec)
    except ValidationError as error:
        raise InvalidSpecError(format_validation_error(error)) from None
