"""`kvpilot serve`'s flags (kvpilot.contract.engine_flags) as the engine's and the server's
settings, whose constructors check their values: what the flags alone can tell is refused here,
before anything loads.

Torch-free on purpose: the operator checks spec.engine.extraArgs with parse_flags, so that an
argument the engine would refuse at start is an InvalidSpec, not a crash-looping pod. What only the
pod can tell (the model, files, the GPUs it sees) is checked by `kvpilot serve` at start
(engine/server/cli.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence

from kvpilot.contract.engine_flags import FlagError, read_flags
from kvpilot.contract.limits import RequestLimits
from kvpilot.contract.lora import RUNTIME_LORA_ENV, is_truthy, parse_lora_module
from kvpilot.engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvpilot.engine.cpu.affinity import CpuPlacement
from kvpilot.engine.server.settings import ChatOptions, ServerSettings


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Map the flags onto the engine's frozen configs (which validate themselves)."""
    return EngineConfig(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        max_model_len=args.max_model_len,
        seed=args.seed,
        served_model_name=args.served_model_name,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_timeout_s=args.distributed_timeout,
        structured_outputs_backend=args.structured_outputs_backend,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_gib=args.kv_cache_gib,
            kv_cache_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_blocks=args.num_gpu_blocks_override,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            policy=args.scheduling_policy,
            guard_window_s=args.priority_guard_window,
            guard_step_seqs=args.priority_guard_seqs,
            guard_step_tokens=args.priority_guard_tokens,
        ),
        lora=lora_config(args),
        speculative=(
            None
            if args.speculative_config is None
            else SpeculativeConfig.from_json(args.speculative_config)
        ),
    )


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """The adapter settings of --enable-lora (None without it; ValueError for adapter flags given
    without it, or a --lora-modules value that does not parse)."""
    if not args.enable_lora:
        if args.lora_modules or args.allow_runtime_lora_updating:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        return None
    modules = tuple(parse_lora_module(value)[:2] for value in args.lora_modules or ())
    return LoRAConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        modules=modules,
        allow_runtime_updating=args.allow_runtime_lora_updating,
    )


def with_runtime_lora_env(config: EngineConfig, env: Mapping[str, str]) -> EngineConfig:
    """Runtime adapter loading switched on by vLLM's environment variable, as vLLM does."""
    if config.lora is None or not is_truthy(env.get(RUNTIME_LORA_ENV)):
        return config
    return dataclasses.replace(
        config, lora=dataclasses.replace(config.lora, allow_runtime_updating=True)
    )


def server_settings(
    args: argparse.Namespace,
    api_key: str | None = None,
    chat: ChatOptions | None = None,
    cpu_placement: CpuPlacement | None = None,
) -> ServerSettings:
    """The server's settings from the flags (ValueError for one out of range); the API key, the
    chat template and the CPU placement of --engine-cpus are found by the caller (from files and
    CPUs only the pod has)."""
    return ServerSettings(
        max_queue=args.max_queue,
        retry_after_s=args.retry_after,
        api_key=api_key,
        limits=request_limits(args),
        chat=chat or ChatOptions(tool_call_parser=args.tool_call_parser),
        shutdown_timeout_s=args.shutdown_timeout,
        cpu_placement=cpu_placement,
        access_log=not args.disable_uvicorn_access_log,
    )


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The request limits the flags set (ValueError for one out of range)."""
    return RequestLimits(
        max_body_bytes=args.max_request_body_bytes,
        max_json_depth=args.max_json_depth,
        max_sequences=args.max_sequences_per_request,
        max_stop=args.max_stop_strings,
        max_logit_bias=args.max_logit_bias,
        max_tokens=args.max_tokens_limit,
    )


def parse_flags(argv: Sequence[str]) -> argparse.Namespace:
    """`argv` read as `kvpilot serve` reads it, with every value check it makes that needs
    neither the model, nor a file, nor the GPUs: FlagError where the command would refuse to
    start."""
    args = read_flags(argv)
    try:
        engine_config(args)
        server_settings(args)
    except ValueError as error:
        raise FlagError(str(error)) from None
    return args
