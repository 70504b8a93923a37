"""Plain-torch attention over the paged KV cache: the fallback path and the test oracle for
kernels."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.attention.kv_quant import dequantize, quantize


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_scale/v_scale: the FP8 cache's scales (None: the cache is in a plain float dtype)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k_scale is not None and v_scale is not None:
        key, value = quantize(key, k_scale, k_cache.dtype), quantize(value, v_scale, v_cache.dtype)
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = key.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = value.to(v_cache.dtype)


def read_kv(kv: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache entries [..., num_kv_heads, head_dim] in the query's dtype."""
    return kv if scale is None else dequantize(kv, scale, dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached entries of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, kvh, D]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def decode_rows(meta: AttentionMetadata) -> tuple[list[int], torch.Tensor]:
    """The sequences with one query token this step, and the flat index of each one's token."""
    starts = [0, *itertools.accumulate(meta.query_lens_cpu)]
    rows = [s for s, q_len in enumerate(meta.query_lens_cpu) if q_len == 1]
    return rows, torch.tensor([starts[s] for s in rows], device=meta.seq_lens.device)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    skip_decodes: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """skip_decodes: leave the rows of single-token sequences unset (another kernel computes
    them); k_scale/v_scale: the FP8 cache's scales (base.py)."""
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    # Token offsets of each sequence, from the host copy: no device sync.
    starts = [0, *itertools.accumulate(meta.query_lens_cpu)]
    rows, token_idx = decode_rows(meta)
    done: set[int] = set()
    if skip_decodes:
        done = set(rows)
    elif len(rows) > 1:
        _decode_batch(query, k_cache, v_cache, meta, scale, rows, token_idx, out, k_scale, v_scale)
        done = set(rows)
    for s in range(meta.num_seqs):
        if s in done:
            continue
        q_len, seq_len = meta.query_lens_cpu[s], meta.seq_lens_cpu[s]
        q = query[starts[s] : starts[s] + q_len]  # [q_len, H, D]
        k = gather_kv(k_cache, meta.block_tables[s], seq_len)  # [seq_len, kvh, D]
        v = gather_kv(v_cache, meta.block_tables[s], seq_len)
        k, v = read_kv(k, k_scale, query.dtype), read_kv(v, v_scale, query.dtype)
        mask = None
        if q_len != seq_len:  # a cached prefix: the causal diagonal is offset
            # Query j sits at absolute position seq_len - q_len + j.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(seq_len, device=query.device)[None, :]
            mask = k_pos <= q_pos  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None and q_len > 1,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[starts[s] : starts[s] + q_len] = o[0].transpose(0, 1)
    return out


def _decode_batch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    rows: list[int],
    token_idx: torch.Tensor,
    out: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """All single-token sequences in one padded batch (the decode steady state)."""
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    rows_t = torch.tensor(rows, device=query.device)
    lens = [meta.seq_lens_cpu[s] for s in rows]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    tables = meta.block_tables[rows_t, :num_blocks].long()  # [B, nb]

    flat_tables = tables.reshape(-1)

    def gather(cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
        # index_select on a 2-D view: one contiguous copy per block, much cheaper than 4-D indexing.
        blocks = cache.view(cache.shape[0], -1).index_select(0, flat_tables)
        kv = blocks.view(len(rows), num_blocks * block_size, num_kv_heads, -1)
        kv = read_kv(kv[:, :max_len], kv_scale, query.dtype)
        return kv.transpose(1, 2)  # [B, KVH, L, D]

    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
    group = num_heads // num_kv_heads
    # Query heads grouped under their KV head: [B, KVH, group, D]. Plain batched matmuls, softmax in
    # float32: on CPU this beats SDPA with a padding mask (its math path), most of all in bfloat16.
    q = query[token_idx].view(len(rows), num_kv_heads, group, -1)
    scores = torch.matmul(q, k.transpose(2, 3)).float() * scale  # [B, KVH, group, L]
    lens_t = torch.tensor(lens, device=query.device)
    padding = torch.arange(max_len, device=query.device)[None, :] >= lens_t[:, None]  # [B, L]
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    o = torch.matmul(probs, v)  # [B, KVH, group, D]
    out[token_idx] = o.reshape(len(rows), num_heads, -1)


class TorchAttentionBackend:
    name = "torch"
    reads_fp8 = True

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_attention_reference(
            query, k_cache, v_cache, meta, scale, k_scale=k_scale, v_scale=v_scale
        )
