"""Bringing up a tensor-parallel engine on rank 0: validate the size, start the other ranks, join
them, load rank 0's shard, and wait until every rank is ready with the same KV pool."""

from __future__ import annotations

import logging
import os

import torch

from kvpilot.engine.config import EngineConfig, ModelConfig
from kvpilot.engine.executor.messages import WorkerArgs
from kvpilot.engine.executor.workers import TPWorkers, WorkerDied
from kvpilot.engine.model.loader import ResolvedModel
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.parallel.group import join_group, leave_group
from kvpilot.engine.parallel.sharding import check_tensor_parallel_size

log = logging.getLogger("kvpilot.tp")


def visible_gpus(config: EngineConfig) -> int | None:
    """GPUs the ranks may use (None on CPU, where ranks share the cores)."""
    if config.resolved_device.type != "cuda":
        return None
    return torch.cuda.device_count() - (config.resolved_device.index or 0)


def threads_per_rank(total: int, size: int) -> int:
    """On CPU the ranks share the cores this process was given: each gets its share."""
    return max(1, total // size)


def start_tensor_parallel(
    config: EngineConfig,
    model_config: ModelConfig,
    source: ResolvedModel,
    max_model_len: int,
    log_level: int,
) -> tuple[ModelRunner, TPWorkers]:
    size = config.tensor_parallel_size
    check_tensor_parallel_size(model_config, size, num_gpus=visible_gpus(config))
    threads = threads_per_rank(torch.get_num_threads(), size)
    torch.set_num_threads(threads)
    args = WorkerArgs(
        config=config,
        hf_dir=str(source.hf_dir),
        load_format=source.load_format,
        max_model_len=max_model_len,
        rank=0,
        init_file="",
        num_threads=threads,
        log_level=log_level,
        parent_pid=os.getpid(),
    )
    workers = TPWorkers.start(args, size)
    log.info(
        "tensor parallel: %d ranks (workers %s), %d threads each",
        size,
        workers.pids,
        threads,
    )
    try:
        tp = join_group(
            0, size, workers.init_file, config.rank_device(0), config.distributed_timeout_s
        )
        runner = ModelRunner(config, model_config, source, max_model_len, tp=tp, workers=workers)
        reports = workers.wait_ready(config.distributed_timeout_s)
    except BaseException:
        workers.stop(0)
        leave_group()
        raise
    disagree = [r for r in reports if r.num_blocks != runner.num_blocks]
    if disagree:
        workers.stop(0)
        leave_group()
        raise WorkerDied(
            f"tensor-parallel ranks disagree on the KV pool: rank 0 has {runner.num_blocks} "
            f"blocks, {[(r.rank, r.num_blocks) for r in disagree]}"
        )
    runner.rank_bytes_loaded = [runner.bytes_loaded, *(r.bytes_loaded for r in reports)]
    return runner, workers
