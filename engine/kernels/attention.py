"""Paged attention for one mixed batch (prefill chunks and decodes) in one launch; split-K too.

One program owns BLOCK_Q consecutive query tokens of one sequence and one KV head, i.e. a tile of
BLOCK_Q * GROUP query rows that all read the same keys (GQA: the group's heads share each K/V load).
It walks the sequence's keys through the block table TILE_N at a time with an online softmax,
stopping at the causal edge of its last query. Decode tokens are just sequences whose query length
is 1.

An FP8 cache (kv_quant.py's format) is read as its uint8 codes, decoded exactly to float16
(numerics.fp8_decode) for the dots; its per-head scales fold into the softmax scale (K) and the
output (V), since a program reads one KV head.

The split-K (flash-decoding) path cuts each program's key range into NUM_SPLITS pieces run by
separate programs, then a second small kernel merges the partial results by their log-sum-exp. It
pays off when the batch has too few (sequence, KV head) pairs to fill the GPU and the contexts are
long.

Nothing here reads a device value on the host, so the launch can be captured in a CUDA graph: the
grid depends only on host-side counts, and sequence lengths are read inside the kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton.language as tl

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.kernels.kv_cache import check_fp8_scales
from kvpilot.engine.kernels.numerics import FP8_FORMATS, cast_to, fp8_decode
from kvpilot.engine.kernels.runtime import next_power_of_2, num_sms, triton_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SPLITS = 32
LOG2E = 1.4426950408889634


# num_seqs changes with every step's batch, and would make eager steps compile new variants.
@triton_kernel(do_not_specialize=("num_seqs",))
def _paged_attention_kernel(
    out_ptr,  # [T, H, D], or the fp32 partials [T, H, NUM_SPLITS, HEAD_DIM_PAD] when split
    lse_max_ptr,  # [T, H, NUM_SPLITS] fp32 running max (log2 domain), only when split
    lse_sum_ptr,  # [T, H, NUM_SPLITS] fp32 softmax denominator, only when split
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]; uint8 codes when FP8
    v_cache_ptr,
    k_scale_ptr,  # [KVH] float32, only when FP8
    v_scale_ptr,
    block_tables_ptr,  # [S, max_blocks] int
    seq_lens_ptr,  # [S]
    query_start_loc_ptr,  # [S + 1]
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    num_seqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    SPARE: tl.constexpr,  # 1 spare query block per sequence, 0 when BLOCK_Q == 1
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * GROUP rounded up to a power of two
    TILE_N: tl.constexpr,  # keys per iteration
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    NUM_SPLITS: tl.constexpr,
    ROWS: tl.constexpr,  # 0: every sequence; 1: only one-token (decode) ones; 2: only the others
    UPCAST: tl.constexpr,  # do the dots in fp32 (fp32 inputs; the CPU interpreter has no bf16 math)
    FP8: tl.constexpr,  # the caches hold FP8 codes with per-head scales
    FP8_MANT: tl.constexpr,  # the FP8 format's mantissa bits (numerics.FP8_FORMATS)
    FP8_F16_FACTOR: tl.constexpr,  # what fp8_decode's float16 values are short of by
    INTERPRET: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence s owns the global query blocks from query_start_loc[s] // BLOCK_Q + s on: one spare
    # block per sequence makes that start computable from query_start_loc alone, so the host never
    # builds a block-to-sequence map (with BLOCK_Q == 1 no spare is needed: block = token). Binary
    # search for the last sequence starting at or before q_block.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid * SPARE <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq * SPARE)
    if q_block_local * BLOCK_Q >= q_len:
        return  # a spare block
    if ROWS == 1:  # noqa: SIM102 (a constexpr branch: compiled out, not a runtime condition)
        if q_len != 1:
            return  # a prefill chunk's token: the other pass has it
    if ROWS == 2:  # noqa: SIM102 (a constexpr branch)
        if q_len == 1:
            return  # a decode: the decode pass has it

    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_tok = q_block_local * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] token index inside the chunk
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    d_ok = offs_d < HEAD_DIM
    token = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix_len + q_tok  # [BLOCK_M] absolute positions

    # Keys this block can see: up to the causal edge of its last valid query.
    kv_end = tl.minimum(seq_len, prefix_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len))
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    qk_scale = scale_log2
    if FP8:
        qk_scale = scale_log2 * (tl.load(k_scale_ptr + kv_head) * FP8_F16_FACTOR)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + offs_n  # [TILE_N]
        k_ok = k_pos < kv_end
        # Per-key block lookup, so TILE_N need not match the cache's block size. (One lookup per
        # tile when a tile sits inside a block was tried: it compiled to more registers on sm_90,
        # not fewer.)
        block_id = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        in_block = k_pos % BLOCK_SIZE
        k_off = block_id * stride_kb + in_block * stride_ks + kv_head * stride_kh
        v_off = block_id * stride_vb + in_block * stride_vs + kv_head * stride_vh
        k = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None],
            mask=k_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [HEAD_DIM_PAD, TILE_N]
        if FP8:
            k = fp8_decode(k, FP8_MANT).to(q.dtype)
        if UPCAST:  # noqa: SIM108 (a constexpr branch, not a value choice)
            qk = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        qk = tl.where(visible, qk * qk_scale, float("-inf"))  # [BLOCK_M, TILE_N]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen no visible key yet keeps max -inf; subtracting 0 instead avoids inf -
        # inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        if FP8:
            v = fp8_decode(v, FP8_MANT).to(q.dtype)
        acc = acc * alpha[:, None]
        if UPCAST:
            acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if FP8:
        acc = acc * (tl.load(v_scale_ptr + kv_head) * FP8_F16_FACTOR)
    if NUM_SPLITS == 1:
        # Rows outside the batch (masked off at the store) see no key: keep them finite.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            cast_to(out, out_ptr.dtype.element_ty, INTERPRET),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        row = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(lse_max_ptr + row, m_i, mask=row_ok)
        tl.store(lse_sum_ptr + row, l_i, mask=row_ok)


@triton_kernel
def _merge_splits_kernel(
    out_ptr,  # [T, H, D]
    partial_ptr,  # [T, H, NUM_SPLITS, HEAD_DIM_PAD] fp32, unnormalized
    lse_max_ptr,  # [T, H, NUM_SPLITS]
    lse_sum_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SKIP_UNTOUCHED: tl.constexpr,  # rows whose first split's sum is still the -1 fill: not ours
    INTERPRET: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if SKIP_UNTOUCHED:  # noqa: SIM102 (a constexpr branch)
        if tl.load(lse_sum_ptr + (token * num_heads + head) * NUM_SPLITS) < 0.0:
            return  # the other pass's row: its output is already in place
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < NUM_SPLITS
    row = (token * num_heads + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    m = tl.load(lse_max_ptr + row, mask=s_ok, other=float("-inf"))
    l = tl.load(lse_sum_ptr + row, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
    total = tl.sum(weight * l, 0)
    part = tl.load(partial_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_ok[:, None])
    out = tl.sum(part * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        cast_to(out, out_ptr.dtype.element_ty, INTERPRET),
        mask=offs_d < HEAD_DIM,
    )


def is_supported(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel handles; the backend sends the rest to the torch reference."""
    return (
        query.dtype in SUPPORTED_DTYPES
        and (k_cache.dtype == query.dtype or k_cache.dtype in FP8_FORMATS)
        and query.shape[-1] <= MAX_HEAD_DIM
        and query.stride(-1) == 1
        and k_cache.stride(-1) == 1
    )


def choose_num_splits(num_programs: int, max_seq_len: int, tile_n: int, sm_count: int) -> int:
    """Split the key range only when the batch leaves SMs idle, with at least 4 tiles per split."""
    if num_programs >= sm_count:
        return 1
    by_length = max_seq_len // (4 * tile_n)
    by_occupancy = math.ceil(2 * sm_count / num_programs)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def _check_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    if query.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"query must be [tokens, heads, head_dim] and k_cache [blocks, block_size, kv_heads, "
            f"head_dim], got {tuple(query.shape)} and {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    cache_ok = k_cache.dtype == v_cache.dtype and (
        k_cache.dtype == query.dtype or k_cache.dtype in FP8_FORMATS
    )
    if not cache_ok or query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"query must be one of {SUPPORTED_DTYPES} and k_cache and v_cache both in its dtype or "
            f"both in one of {tuple(FP8_FORMATS)}, got {query.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}"
        )
    check_fp8_scales(k_cache, k_scale, v_scale)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim must match and be <= {MAX_HEAD_DIM}: query {head_dim}, "
            f"cache {k_cache.shape[3]}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("query, k_cache and v_cache must be contiguous in head_dim")
    if query.shape[0] != meta.num_tokens:
        raise ValueError(f"query has {query.shape[0]} tokens, the metadata {meta.num_tokens}")
    num_seqs = meta.num_seqs
    if (
        tuple(meta.query_start_loc.shape) != (num_seqs + 1,)
        or tuple(meta.seq_lens.shape) != (num_seqs,)
        or meta.block_tables.dim() != 2
        or meta.block_tables.shape[0] != num_seqs
    ):
        raise ValueError(
            f"metadata shapes disagree with {num_seqs} sequences: query_start_loc "
            f"{tuple(meta.query_start_loc.shape)}, seq_lens {tuple(meta.seq_lens.shape)}, "
            f"block_tables {tuple(meta.block_tables.shape)}"
        )
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        t = getattr(meta, name)
        if t.dtype not in (torch.int32, torch.int64) or t.device != query.device:
            raise ValueError(
                f"{name} must be int32/int64 on {query.device}, got {t.dtype} on {t.device}"
            )
    if meta.block_tables.shape[1] and meta.block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous along its rows")


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    tile_n: int | None = None,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's cached keys: [num_tokens, H, D].

    num_splits: None picks split-K by occupancy on CUDA (never on CPU); tile_n: keys per iteration;
    num_warps and num_stages (None: by tiling): the launches', for tuning (bench/); k_scale and
    v_scale: [KVH] float32, given exactly when the caches are FP8 (kv_quant.py).
    """
    _check_inputs(query, k_cache, v_cache, meta, k_scale, v_scale)
    num_tokens, num_heads = query.shape[:2]
    group = num_heads // k_cache.shape[2]
    num_seqs = meta.num_seqs
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be like query {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)}"
        )
    if num_tokens == 0:
        return out

    # Decode-only batches get one token per program; prefill chunks up to 64 rows of (token, head).
    # A mixed batch runs in two passes: its decodes in the decode tiling, then its chunks (one
    # launch in the prefill tiling took 2.1x as long as the two passes on an H200 at 384 decodes
    # + a 256-token chunk, bench/RESULTS.md). Each pass's grid covers the whole batch and its
    # programs skip the other kind's sequences, so it needs no host count of either: a CUDA graph
    # of a mixed step, whose host lengths are only bounds (0 for its padded sequences), does both.
    sm_count = num_sms(query.device.index or 0) if query.device.type == "cuda" else None
    passes = planned_passes(num_tokens, num_seqs, meta.max_query_len, min(meta.query_lens_cpu),
                            meta.max_seq_len, k_cache.shape[2], group, query.shape[2], sm_count,
                            tile_n)  # fmt: skip
    for p in passes:
        _launch(query, k_cache, v_cache, meta, scale, out, block_q=p.block_q, rows=p.rows,
                num_splits=p.num_splits if num_splits is None else num_splits, tile_n=tile_n,
                num_warps=num_warps, num_stages=num_stages, k_scale=k_scale,
                v_scale=v_scale)  # fmt: skip
    return out


def planned_passes(
    num_tokens: int,
    num_seqs: int,
    max_query_len: int,
    min_query_len: int,
    max_seq_len: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    sm_count: int | None,
    tile_n: int | None = None,
) -> list[CompiledPass]:
    """The launches paged_attention makes for a batch: each pass's tiling, rows and split count
    (split-K by occupancy on a GPU of sm_count SMs; None: the CPU, never split)."""
    passes = []
    for block_q, rows in pass_tilings(num_seqs, max_query_len, min_query_len, group):
        splits = 1
        if sm_count is not None:
            keys_per_tile = default_tile_n(block_q, head_dim) if tile_n is None else tile_n
            splits = split_count(num_tokens, num_seqs, block_q, num_kv_heads, max_seq_len,
                                 keys_per_tile, sm_count)  # fmt: skip
        passes.append(CompiledPass(block_q, rows, splits))
    return passes


def pass_tilings(
    num_seqs: int, max_query_len: int, min_query_len: int, group: int
) -> list[tuple[int, int]]:
    """(BLOCK_Q, ROWS) of each launch a batch takes: see paged_attention."""
    mixed = max_query_len > 1
    decode_pass = not mixed or (num_seqs > 1 and min_query_len <= 1)
    passes = []
    if decode_pass:
        passes.append((1, 1 if mixed else 0))
    if mixed:
        block_q = min(max_block_q(group), next_power_of_2(max_query_len))
        passes.append((block_q, 2 if decode_pass else 0))
    return passes


def max_block_q(group: int) -> int:
    """Prefill tiles hold up to 64 rows of (token, head): this many tokens of a GQA group."""
    return max(1, 64 // group)


def default_tile_n(block_q: int, head_dim: int) -> int:
    """Keys per iteration: decode tiles of 128 keys were 6-9% faster than 64 at 256-512 sequences
    of ~400 tokens on an H200 (bench/RESULTS.md)."""
    if max(16, next_power_of_2(head_dim)) > 128:
        return 32
    return 128 if block_q == 1 else 64


def split_count(
    num_tokens: int,
    num_seqs: int,
    block_q: int,
    num_kv_heads: int,
    max_seq_len: int,
    tile_n: int,
    sm_count: int,
) -> int:
    """A launch's NUM_SPLITS on CUDA (choose_num_splits over its programs)."""
    programs = num_query_blocks(num_tokens, num_seqs, block_q) * num_kv_heads
    return choose_num_splits(programs, max_seq_len, tile_n, sm_count)


def num_query_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """The grid's first dimension: BLOCK_Q tokens per program, and with BLOCK_Q > 1 one spare
    block per sequence (see the kernel)."""
    return num_tokens // block_q + num_seqs * (0 if block_q == 1 else 1)


@dataclass(frozen=True, order=True)
class CompiledPass:
    """What picks one compiled variant of the kernel (with the merge kernel's, when split)."""

    block_q: int
    rows: int
    num_splits: int


def eager_passes(
    min_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    sm_count: int,
) -> set[CompiledPass]:
    """Every pass a step of min_tokens or more can launch (a superset: some may never come).
    Integer arguments that change from step to step are not specialized, so the tiling, the rows
    and the split count alone pick the variant. A split count is largest at the fewest programs
    (num_tokens // block_q + one spare per sequence, times the KV heads) and the longest context,
    and every count below it is reachable with a shorter context."""
    passes = set()
    tilings = {(1, 1)} | ({(1, 0)} if max_num_seqs >= min_tokens else set())
    block_q = 2  # a chunk's pass: min(max_block_q, a power of two >= 2)
    while True:
        capped = min(block_q, max_block_q(group))
        tilings |= {(capped, 0), (capped, 2)}
        if block_q >= max_block_q(group):
            break
        block_q *= 2
    for block_q, rows in tilings:
        tile_n = default_tile_n(block_q, head_dim)
        # The fewest programs: one sequence (a decode pass has no spare blocks anyway).
        most = split_count(min_tokens, 1, block_q, num_kv_heads, max_model_len, tile_n, sm_count)
        passes |= {CompiledPass(block_q, rows, n) for n in range(1, most + 1)}
    return passes


def compile_passes(
    passes: set[CompiledPass],
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_dtype: torch.dtype | None = None,
) -> None:
    """Launches each pass once on a two-token batch (a block table 16 wide, as CUDA steps' are),
    so that its variant is compiled now: see eager_passes. query_dtype: the model's (None: the
    cache's, which an FP8 cache cannot stand for)."""
    device, head_dim = k_cache.device, k_cache.shape[3]
    fp8 = k_cache.dtype in FP8_FORMATS
    if query_dtype is None:
        if fp8:
            raise ValueError("compile_passes needs query_dtype for an FP8 cache")
        query_dtype = k_cache.dtype
    query = torch.zeros(2, num_heads, head_dim, dtype=query_dtype, device=device)
    # The scales' values do not matter here (the cache is not read for the output's sake).
    scales = torch.ones(k_cache.shape[2], dtype=torch.float32, device=device) if fp8 else None

    def ints(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    meta = AttentionMetadata(
        query_start_loc=ints([0, 1, 2]),
        seq_lens=ints([1, 1]),
        block_tables=ints([[0] * 16, [0] * 16]),
        slot_mapping=torch.zeros(2, dtype=torch.int64, device=device),
        max_query_len=1,
        max_seq_len=1,
        query_lens_cpu=(1, 1),
        seq_lens_cpu=(1, 1),
    )
    out = torch.empty_like(query)
    for p in sorted(passes):
        _launch(query, k_cache, v_cache, meta, 1.0, out, block_q=p.block_q, rows=p.rows,
                num_splits=p.num_splits, tile_n=None, num_warps=None, num_stages=None,
                k_scale=scales, v_scale=scales)  # fmt: skip


def _launch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    *,
    block_q: int,
    rows: int,
    num_splits: int,
    tile_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = meta.num_seqs
    block_m = max(16, next_power_of_2(block_q * group))
    head_dim_pad = max(16, next_power_of_2(head_dim))
    decode_tiles = block_q == 1
    if tile_n is None:
        tile_n = default_tile_n(block_q, head_dim)
    if num_stages is None:  # 3 for decode tiles: with 128 keys, as default_tile_n says
        num_stages = 3 if decode_tiles and head_dim_pad <= 128 else 2
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    spare = 0 if block_q == 1 else 1
    num_q_blocks = num_query_blocks(num_tokens, num_seqs, block_q)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")

    upcast = query.dtype == torch.float32 or query.device.type == "cpu"
    if num_splits > 1:
        partial = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim_pad),
            dtype=torch.float32,
            device=query.device,
        )
        lse_max = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        # A pass over part of the batch marks the rows it never reaches, for the merge to skip.
        lse_sum = torch.empty_like(lse_max) if rows == 0 else torch.full_like(lse_max, -1.0)
        target, stride_ot, stride_oh = partial, 0, 0
    else:
        target, lse_max, lse_sum = out, out, out  # the lse pointers are unused without splits
        stride_ot, stride_oh = out.stride(0), out.stride(1)

    fmt = FP8_FORMATS.get(k_cache.dtype)
    if fmt is not None:  # the kernel reads the codes; Triton's FP8 types are not used (numerics.py)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    kernel = _paged_attention_kernel.on(query.device)
    kernel[(num_q_blocks, num_kv_heads, num_splits)](
        target,
        lse_max,
        lse_sum,
        query,
        k_cache,
        v_cache,
        k_scale if fmt else meta.seq_lens,  # unread without FP8
        v_scale if fmt else meta.seq_lens,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale * LOG2E,
        num_seqs,
        num_heads,
        query.stride(0),
        query.stride(1),
        stride_ot,
        stride_oh,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        BLOCK_Q=block_q,
        SPARE=spare,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        ROWS=rows,
        UPCAST=upcast,
        FP8=fmt is not None,
        FP8_MANT=fmt.mant if fmt else 0,
        FP8_F16_FACTOR=fmt.f16_factor if fmt else 1.0,
        INTERPRET=query.device.type == "cpu",
        # Compiled for sm_90: BLOCK_M 64 x TILE_N 64 x D 128 took 189-223 registers with 4 warps,
        # 128-134 with 8; decode tiles (BLOCK_M 16) about 93 with 4. No spills in the chosen ones.
        num_warps=num_warps or (8 if block_m * head_dim_pad >= 64 * 128 else 4),
        num_stages=num_stages,
    )
    if num_splits > 1:
        merge = _merge_splits_kernel.on(query.device)
        merge[(num_tokens, num_heads)](
            out,
            partial,
            lse_max,
            lse_sum,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=next_power_of_2(num_splits),
            SKIP_UNTOUCHED=rows != 0,
            INTERPRET=query.device.type == "cpu",
            num_warps=4,
        )


__all__ = [
    "CompiledPass",
    "choose_num_splits",
    "compile_passes",
    "eager_passes",
    "is_supported",
    "paged_attention",
    "pass_tilings",
    "planned_passes",
]
