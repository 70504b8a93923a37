"""The 'cpu' attention backend: attention reads the paged cache directly in small C kernels
(csrc/cpu_ops.c): one for steps of decodes only, one for any step (prefill chunks, over a cached
prefix or not, and decodes), each a single call per layer.

On CPU the torch path's decode cost is mostly memory traffic of its own making: gathering every
sequence's blocks into a contiguous copy, then copying again for the batched matmuls. The C kernels
read each cached key and value in place, with an online softmax over chunks of the context; for a
prefill chunk, once per tile of query rows instead of one SDPA call (and gather) per sequence.

The kernels are compiled on first use with the host's C compiler (`cc`, or $CC) for this machine's
instruction set (see build.py). Without a compiler, or for shapes and dtypes the kernel does not
cover, everything goes to the torch reference: choosing this backend never changes what the engine
can run, only how fast.
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.attention.torch_ref import (
    decode_rows,
    paged_attention_reference,
)
from kvpilot.engine.cpu.build import SUFFIXES, load_library
from kvpilot.engine.cpu.layer_ops import kernels_take, write_kv

MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 256


def is_supported(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (
        kernels_take(k_cache, v_cache)
        and query.device.type == "cpu"
        and query.dtype == k_cache.dtype
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and k_cache.shape[1] <= MAX_BLOCK
    )


def paged_decode(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [S, H, D] (one token per sequence) -> [S, H, D]; block_tables [S, *] int32, seq_lens
    [S] int32, every length >= 1."""
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    num_seqs, num_heads, head_dim = query.shape
    getattr(lib, f"paged_decode_{SUFFIXES[query.dtype]}")(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        block_tables.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        scale,
    )
    return out


def paged_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor | None:
    """Causal attention of every query token of the step: query [T, H, D] -> [T, H, D], or None
    when the kernel could not allocate its work list."""
    query = query.contiguous()
    block_tables = meta.block_tables.to(torch.int32).contiguous()
    query_start_loc = meta.query_start_loc.to(torch.int32).contiguous()
    seq_lens = meta.seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    failed = getattr(lib, f"paged_attention_{SUFFIXES[query.dtype]}")(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        meta.num_seqs,
        num_heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        block_tables.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        scale,
    )
    return None if failed else out


class CpuAttentionBackend:
    name = "cpu"
    # False: steps with prefill chunks take the torch reference per sequence (and the decode kernel
    # for their decodes): the reference the varlen kernel is measured against (bench/RESULTS.md).
    varlen_kernel = True

    def __init__(self) -> None:
        self.lib = load_library()

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv(self.lib, key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if self.lib is None or not is_supported(query, k_cache, v_cache):
            return paged_attention_reference(query, k_cache, v_cache, meta, scale)
        if meta.is_decode_only:
            return paged_decode(
                self.lib, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale
            )
        if self.varlen_kernel:
            out = paged_attention(self.lib, query, k_cache, v_cache, meta, scale)
            if out is not None:
                return out
        rows, token_idx = decode_rows(meta)
        out = paged_attention_reference(query, k_cache, v_cache, meta, scale, skip_decodes=True)
        if rows:
            rows_t = torch.tensor(rows)
            out[token_idx] = paged_decode(
                self.lib,
                query[token_idx],
                k_cache,
                v_cache,
                meta.block_tables[rows_t],
                meta.seq_lens[rows_t],
                scale,
            )
        return out
