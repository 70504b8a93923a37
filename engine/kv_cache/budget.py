"""How many KV blocks a memory budget holds: the budget from the cache config and the device, the
bytes of one block from the model's shape, and the rule that turns them into a count."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class DraftReserve:
    """What a speculative draft model takes of the target's GPU once the target's pool is
    allocated (spec_decode/draft_model.py): its weights, and a KV pool of as many tokens as the
    target's pool holds, up to max_kv_tokens."""

    weight_bytes: int
    kv_bytes_per_token: int
    max_kv_tokens: int


def num_blocks_beside_draft(
    budget: int, bytes_per_block: int, block_size: int, draft: DraftReserve
) -> int:
    """The most target blocks that fit in budget together with the draft: its weights and its
    pool of min(the target's tokens, max_kv_tokens) tokens."""
    left = budget - draft.weight_bytes
    # While the draft's pool grows with the target's, each target block brings a draft block.
    num_blocks = left // (bytes_per_block + block_size * draft.kv_bytes_per_token)
    if num_blocks * block_size > draft.max_kv_tokens:
        # Past max_kv_tokens the draft's pool is fixed: the rest is the target's alone.
        left -= draft.max_kv_tokens * draft.kv_bytes_per_token
        num_blocks = left // bytes_per_block
    return max(0, num_blocks)


def decide_num_blocks(
    cache: CacheConfig,
    device: torch.device,
    bytes_per_block: int,
    tp: TPGroup | None,
    draft: DraftReserve | None = None,
) -> int:
    """The pool's block count: the configured override, else what the budget holds (on GPUs the
    smallest rank's). On a GPU whose budget is what gpu_memory_utilization leaves, a draft
    model's share comes out of it first (on CPU the start-up memory check counts the draft
    beside the KV budget). ValueError when not one block fits."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    budget = kv_budget_bytes(cache, device)
    on_gpu = device.type == "cuda"
    if on_gpu and draft is not None and cache.kv_cache_bytes is None:
        num_blocks = num_blocks_beside_draft(budget, bytes_per_block, cache.block_size, draft)
    else:
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
