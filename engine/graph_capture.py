"""Start-up work of a CUDA engine that no request should wait for: the step graphs captured, and
every kernel variant an eager step can launch compiled once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvpilot.engine.config import EngineConfig, ModelConfig
from kvpilot.engine.cuda_graphs import (
    StepGraphs,
    eager_steps_to_compile,
    eager_warmup_plan,
    graph_batch_sizes,
    mixed_token_sizes,
)
from kvpilot.engine.kernels.runtime import compiled_variants, num_sms
from kvpilot.engine.kv_cache.pool import PagedKVPool
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.step_input import StepInput

log = logging.getLogger("kvpilot")


def uses_step_graphs(config: EngineConfig, device: torch.device, backend_name: str, *,
                     tensor_parallel: bool) -> bool:  # fmt: skip
    return (
        device.type == "cuda"
        and backend_name == "triton"
        and not tensor_parallel
        and not config.enforce_eager
        # The step graphs' buffers and forward context carry no FP8 scales (cuda_graphs.py): an
        # FP8 cache runs its steps eagerly.
        and config.cache.kv_cache_dtype == "auto"
    )


def capture_step_graphs(
    model: LlamaForCausalLM, pool: PagedKVPool, config: EngineConfig, max_model_len: int
) -> StepGraphs:
    if pool.null_block is None:
        raise ValueError("step graphs need a KV pool with a null block for their padded rows")
    sched = config.scheduler
    return StepGraphs(
        model,
        pool.layers,
        graph_batch_sizes(sched.max_num_seqs),
        mixed_token_sizes(sched.max_num_batched_tokens),
        sched.max_num_seqs,
        max_model_len,
        pool.block_size,
        pool.null_block,
    )


def compile_eager_variants(
    graphs: StepGraphs,
    forward_step: Callable[[StepInput], object],
    config: EngineConfig,
    model_config: ModelConfig,
    pool: PagedKVPool,
    table_width_multiple: int,
) -> None:
    """Runs once each kind of step no graph holds (more tokens than the largest mixed graph,
    more decodes than any graph), so the kernel variants they launch are compiled now and not
    while a request waits: on an H100, the first pass over a 1000-request workload compiled
    for ~2.5 s of its 22.8 s (bench/RESULTS.md)."""
    from kvpilot.engine.kernels import attention  # CUDA graphs imply Triton

    sched = config.scheduler
    plan = eager_warmup_plan(
        graphs, sched.max_num_batched_tokens, sched.max_num_seqs, pool.num_blocks
    )
    if plan is None:
        return
    num_tokens, decode_seqs = plan
    started = time.perf_counter()
    before = sum(compiled_variants().values())
    steps = eager_steps_to_compile(num_tokens, pool.block_size, table_width_multiple, decode_seqs)
    for step in steps:
        if graphs.shape_for(step) is not None:
            raise AssertionError(f"a warm-up step of {num_tokens} tokens fits a graph")
        forward_step(step)
    # Those steps launch only some of the attention passes an eager step can: a split count
    # depends on the batch and its longest context. Every one of them, directly.
    cfg = model_config
    k_cache, v_cache = pool.layers[0]
    passes = attention.eager_passes(
        num_tokens,
        sched.max_num_seqs,
        graphs.max_model_len,
        cfg.num_key_value_heads,
        cfg.num_attention_heads // cfg.num_key_value_heads,
        cfg.head_dim,
        num_sms(pool.device.index or 0),
    )
    # The hidden states' dtype is the queries': an FP8 cache's is not.
    attention.compile_passes(
        passes, cfg.num_attention_heads, k_cache, v_cache, query_dtype=graphs.hidden.dtype
    )
    torch.cuda.synchronize(pool.device)
    log.info(
        "eager steps (%d tokens and more): %d kernel variants compiled in %.1f s",
        num_tokens,
        sum(compiled_variants().values()) - before,
        time.perf_counter() - started,
    )
