"""spec.engine.extraArgs read by `kvpilot serve`'s own argument parser (torch-free), so that what
the engine would refuse at start is an InvalidSpec instead of a crash-looping pod: an unknown
flag, a missing or malformed value, a value out of range, -h, or a device the pod's GPUs
(spec.gpus) cannot serve. Options the operator sets from the spec are refused too, however
written (`--port=1`, an abbreviation, an alias such as -tp): appended last, they would silently
win over the spec field, and the pod's contract (probes, the Service, the drain, the memory
check, the API key's Secret) is built from the spec.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.contract.cpus import whole_cpus
from kvpilot.contract.engine_flags import FlagError, read_flags
from kvpilot.contract.kube import ENGINE_PORT
from kvpilot.contract.lora import RUNTIME_LORA_FLAG
from kvpilot.engine.server.from_flags import engine_config, parse_flags

# `kvpilot serve` option (argparse dest) -> (its flag, what sets it instead). The builder's own
# flags must all be here (tests/operator/test_extra_args.py checks it).
SET_BY_THE_OPERATOR: dict[str, tuple[str, str]] = {
    "host": ("--host", f"the operator sets it (the engine must listen on 0.0.0.0:{ENGINE_PORT})"),
    "port": ("--port", f"the operator sets it (the engine must listen on 0.0.0.0:{ENGINE_PORT})"),
    "model": ("--model", "the operator sets it (the model comes from spec.model.uri)"),
    "served_model_name": ("--served-model-name", "set spec.model.servedName"),
    "block_size": ("--block-size", "set spec.engine.blockSize"),
    "max_model_len": ("--max-model-len", "set spec.engine.maxModelLen"),
    "max_num_seqs": ("--max-num-seqs", "set spec.engine.maxNumSeqs"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "set spec.engine.maxNumBatchedTokens"),
    "dtype": ("--dtype", "set spec.engine.dtype"),
    "kv_cache_dtype": ("--kv-cache-dtype", "set spec.engine.kvCacheDtype"),
    "gpu_memory_utilization": (
        "--gpu-memory-utilization",
        "set spec.engine.gpuMemoryUtilization",
    ),
    "kv_cache_memory_bytes": (
        "--kv-cache-memory-bytes",
        "set spec.engine.kvCacheBytes or spec.engine.kvCacheMemoryFraction",
    ),
    # The KV budget is the spec's: the operator's memory check (limit vs the engine's need) and
    # the engine's own at start must add up the same bytes.
    "kv_cache_gib": (
        "--kv-cache-gib",
        "set spec.engine.kvCacheBytes (the memory limit is checked against it)",
    ),
    "num_gpu_blocks_override": (
        "--num-gpu-blocks-override",
        "set spec.engine.kvCacheBytes (the memory limit is checked against it)",
    ),
    "enable_prefix_caching": ("--enable-prefix-caching", "set spec.engine.enablePrefixCaching"),
    "structured_outputs_backend": (
        "--structured-outputs-backend",
        "set spec.engine.structuredOutputsBackend",
    ),
    "tool_call_parser": ("--tool-call-parser", "set spec.engine.toolCallParser"),
    "chat_template": ("--chat-template", "set spec.engine.chatTemplate"),
    "tensor_parallel_size": (
        "--tensor-parallel-size",
        "set spec.engine.tensorParallelSize (spec.gpus by default)",
    ),
    # The router forwards each tenant's priority; the policy decides whether replicas heed it.
    "scheduling_policy": ("--scheduling-policy", "set spec.engine.schedulingPolicy"),
    "shutdown_timeout": (
        "--shutdown-timeout",
        "set spec.drainSeconds (the pod's grace period follows it)",
    ),
    # LoRA: on, with its limits, from spec.engine.lora / spec.adapters; the adapters themselves
    # are loaded through the engine's API, so that adding one restarts no pod.
    "enable_lora": ("--enable-lora", "set spec.engine.lora or spec.adapters"),
    "max_loras": ("--max-loras", "set spec.engine.lora.maxLoras"),
    "max_lora_rank": ("--max-lora-rank", "set spec.engine.lora.maxLoraRank"),
    "max_cpu_loras": ("--max-cpu-loras", "set spec.engine.lora.maxCpuLoras"),
    "allow_runtime_lora_updating": (
        RUNTIME_LORA_FLAG,
        "the operator sets it with spec.engine.lora or spec.adapters",
    ),
    "lora_modules": (
        "--lora-modules",
        "list them in spec.adapters: the operator loads them into the running replicas",
    ),
    "api_key": (
        "--api-key",
        "the key would show in the Deployment and the process list: use spec.engine.apiKeySecret",
    ),
    "api_key_file": (
        "--api-key-file",
        "the operator hands the engine its key from spec.engine.apiKeySecret (a Secret)",
    ),
}

# Options no spec can set right: dest -> (flag, why, and what instead).
UNKNOWABLE_IN_A_POD: dict[str, tuple[str, str]] = {
    "engine_cpus": (
        "--engine-cpus",
        "a pod's CPU numbers are known only once it runs on a node: use --api-cpus N",
    ),
}


def check_extra_args(args: Sequence[str]) -> None:
    """ValueError, with the engine parser's own message, for extraArgs that cannot be used."""
    try:
        given = read_flags(args, only_given=True)
        for dest in vars(given):
            if dest in SET_BY_THE_OPERATOR or dest in UNKNOWABLE_IN_A_POD:
                flag, instead = SET_BY_THE_OPERATOR.get(dest) or UNKNOWABLE_IN_A_POD[dest]
                raise ValueError(f"extraArgs may not set {flag}: {instead}")
        parse_flags(args)
    except FlagError as error:
        raise ValueError(f"`kvpilot serve` would refuse them: {error}") from None


def check_placement(
    args: Sequence[str], *, gpus: int, dtype: str | None, tensor_parallel_size: int
) -> None:
    """ValueError where the engine, with these extraArgs and the spec's settings, would refuse a
    pod with `gpus` GPUs at start (`--device cuda` without a GPU, float16 on `--device cpu`),
    by the engine's own rule (EngineConfig.check_placement). `args` passed check_extra_args."""
    spec_set = ["--dtype", dtype or "auto", "--tensor-parallel-size", str(tensor_parallel_size)]
    try:
        engine_config(parse_flags([*spec_set, *args])).check_placement(gpus)
    except ValueError as error:
        raise ValueError(
            f"engine.extraArgs: `kvpilot serve` would refuse them in a pod with {gpus} GPU(s) "
            f"(spec.gpus): {error}"
        ) from None


def check_api_cpus(args: Sequence[str], cpu_limit: float | None) -> None:
    """ValueError where --api-cpus N leaves the engine core none of the pod's CPUs: at least N
    whole CPUs of resources.limits.cpu (the engine's own rule at start, kvpilot.contract.cpus,
    with or without a cpuset). `args` passed check_extra_args."""
    api_cpus = parse_flags(args).api_cpus
    if api_cpus is None or cpu_limit is None:
        return
    if api_cpus >= whole_cpus(cpu_limit):
        raise ValueError(
            f"engine.extraArgs: --api-cpus {api_cpus} leaves the engine core no CPU of "
            f"resources.limits.cpu ({cpu_limit:g} CPUs): give the pod more, or the API fewer"
        )
