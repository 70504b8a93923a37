"""The log-likelihood of a fixed text under a loaded model and its KV pool, teacher-forced in
prefill chunks, so that every chunk after the first reads the earlier tokens' keys and values
back from the cache (in the pool's dtype: how an FP8 cache's accuracy is measured, tests and
bench/fp8_kv_accuracy.py)."""

from __future__ import annotations

import math

import torch

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.kv_cache.base import KVCachePool
from kvpilot.engine.model.llama import ForwardContext, LlamaForCausalLM


@torch.inference_mode()
def text_logprobs(
    model: LlamaForCausalLM, pool: KVCachePool, token_ids: list[int], chunk: int
) -> torch.Tensor:
    """log p(token_ids[i] | token_ids[:i]) for i = 1.., float32 [len - 1]. Uses the pool's first
    blocks as scratch: the pool must be idle, and what its blocks held is overwritten (reset the
    prefix cache afterwards)."""
    n, block_size = len(token_ids), pool.block_size
    num_blocks = -(-n // block_size)
    if num_blocks > pool.num_blocks:
        raise ValueError(f"{n} tokens need {num_blocks} KV blocks; the pool has {pool.num_blocks}")
    device = pool.device
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    out = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
            block_tables=table,
            slot_mapping=torch.arange(start, end, dtype=torch.int64, device=device),
            max_query_len=end - start,
            max_seq_len=end,
            query_lens_cpu=(end - start,),
            seq_lens_cpu=(end,),
        )
        positions = torch.arange(start, end, device=device)
        ctx = ForwardContext(positions, meta, pool.layers, kv_scales=pool.scales)
        logits = model.compute_logits(model(ids[start:end], ctx))
        assert logits is not None, "text_logprobs runs on the rank that holds the logits"
        out.append(torch.log_softmax(logits.float(), dim=-1))
    logprobs = torch.cat(out)[:-1]  # position i predicts token i + 1
    return logprobs.gather(1, ids[1:, None]).squeeze(1).cpu()


def perplexity(logprobs: torch.Tensor) -> float:
    return math.exp(-float(logprobs.double().mean()))
