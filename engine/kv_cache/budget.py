"""How many KV blocks a memory budget holds: the budget from the cache config and the device, the
bytes of one block from the model's shape, and the rule that turns them into a count."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpilot.contract.sizing import kv_bytes_per_token
from kvpilot.engine.config import CacheConfig

if TYPE_CHECKING:
    import torch

    from kvpilot.engine.parallel.group import TPGroup


def kv_bytes_per_block(
    *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, itemsize: int
) -> int:
    """K and V of one block over every layer; num_kv_heads is this rank's (the whole model's
    without tensor parallelism)."""
    per_token = kv_bytes_per_token(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, itemsize=itemsize
    )
    return per_token * block_size


def kv_budget_bytes(cache: CacheConfig, device: torch.device) -> int:
    """The bytes the KV cache may take: an explicit budget, else on a GPU what
    gpu_memory_utilization leaves once the weights are resident (less room for one full step's
    activations), else the CPU budget."""
    if cache.kv_cache_bytes is not None:
        return cache.kv_cache_bytes
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        reserve = 0.05 * total + 2**30
        return int(cache.gpu_memory_utilization * total - (total - free) - reserve)
    return int(cache.kv_cache_gib * 2**30)


def num_blocks_in_budget(budget: int, bytes_per_block: int, *, on_gpu: bool, num_ranks: int) -> int:
    """A GPU budget is each GPU's and holds its rank's share of a block; the CPU budget is the
    host memory of the whole KV cache over every rank (ranks share the host), so one block counts
    once per rank, replicated KV heads as many times as they are held."""
    if on_gpu:
        return budget // bytes_per_block
    return max(0, budget // (num_ranks * bytes_per_block))


def decide_num_blocks(
    cache: CacheConfig, device: torch.device, bytes_per_block: int, tp: TPGroup | None
) -> int:
    """The pool's block count: the configured override, else what the budget holds (on GPUs the
    smallest rank's). ValueError when not one block fits."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    budget = kv_budget_bytes(cache, device)
    on_gpu = device.type == "cuda"
    num_blocks = num_blocks_in_budget(
        budget, bytes_per_block, on_gpu=on_gpu, num_ranks=1 if tp is None else tp.size
    )
    if on_gpu and tp is not None:
        num_blocks = tp.min_over_ranks(num_blocks, device)
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: the budget of {budget / 2**30:.2f} GiB holds no block "
            f"of {bytes_per_block / 2**20:.1f} MiB (raise kv_cache_bytes, "
            f"kv_cache_gib or gpu_memory_utilization)"
        )
    return num_blocks
