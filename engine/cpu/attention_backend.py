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

An FP8 cache (kv_quant.py) is read by the same kernels built per cache dtype (a table decodes each
byte); its scales are folded into the query and the output, never into the inner loops. The write
quantizes in torch (write_kv_reference), a few elementwise ops on this step's new rows only.
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.attention.torch_ref import (
    decode_rows,
    paged_attention_reference,
    write_kv_reference,
)
from kvpilot.engine.cpu.build import FP8_SUFFIXES, SUFFIXES, load_library
from kvpilot.engine.cpu.layer_ops import kernels_take, write_kv

MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 256


def is_supported(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.dtype in FP8_SUFFIXES:
        cache_ok = (
            kernels_take(query)
            and k_cache.dtype == v_cache.dtype
            and k_cache.stride(-1) == 1
            and v_cache.stride(-1) == 1
        )
    else:
        cache_ok = kernels_take(k_cache, v_cache) and query.dtype == k_cache.dtype
    return (
        cache_ok
        and query.device.type == "cpu"
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and k_cache.shape[1] <= MAX_BLOCK
    )


def kernel_name(name: str, query: torch.Tensor, k_cache: torch.Tensor) -> str:
    """paged_decode_bf16, or paged_decode_bf16_e4m3 for an FP8 cache."""
    fp8 = FP8_SUFFIXES.get(k_cache.dtype)
    return f"{name}_{SUFFIXES[query.dtype]}" + ("" if fp8 is None else f"_{fp8}")


def scale_ptrs(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[int | None, int | None]:
    """The scales' addresses (None: NULL, a cache without scales)."""
    for s in (k_scale, v_scale):
        if s is not None and (s.dtype != torch.float32 or not s.is_contiguous()):
            raise ValueError(f"KV scales must be contiguous float32, got {s.dtype}")
    return (
        None if k_scale is None else k_scale.data_ptr(),
        None if v_scale is None else v_scale.data_ptr(),
    )


def paged_decode(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [S, H, D] (one token per sequence) -> [S, H, D]; block_tables [S, *] int32, seq_lens
    [S] int32, every length >= 1; k_scale/v_scale [KVH] float32 for an FP8 cache."""
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    num_seqs, num_heads, head_dim = query.shape
    getattr(lib, kernel_name("paged_decode", query, k_cache))(
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
        *scale_ptrs(k_scale, v_scale),
    )
    return out


def paged_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Causal attention of every query token of the step: query [T, H, D] -> [T, H, D], or None
    when the kernel could not allocate its work list."""
    query = query.contiguous()
    block_tables = meta.block_tables.to(torch.int32).contiguous()
    query_start_loc = meta.query_start_loc.to(torch.int32).contiguous()
    seq_lens = meta.seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    failed = getattr(lib, kernel_name("paged_attention", query, k_cache))(
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
        *scale_ptrs(k_scale, v_scale),
    )
    return None if failed else out


class CpuAttentionBackend:
    name = "cpu"
    reads_fp8 = True
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
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        if k_scale is not None or v_scale is not None:
            write_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return
        write_kv(self.lib, key, value, k_cache, v_cache, slot_mapping)

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
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        if self.lib is None or not is_supported(query, k_cache, v_cache):
            return paged_attention_reference(query, k_cache, v_cache, meta, scale, **scales)
        if meta.is_decode_only:
            return paged_decode(
                self.lib, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, **scales
            )
        if self.varlen_kernel:
            out = paged_attention(self.lib, query, k_cache, v_cache, meta, scale, **scales)
            if out is not None:
                return out
        rows, token_idx = decode_rows(meta)
        out = paged_attention_reference(
            query, k_cache, v_cache, meta, scale, skip_decodes=True, **scales
        )
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
                **scales,
            )
        return out
