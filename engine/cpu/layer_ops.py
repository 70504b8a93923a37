"""Rotary embedding, RMSNorm, SiLU-and-multiply and the KV-cache write through the C kernels, with
the signatures of kvpilot.engine.model.layers.apply_rotary, rms_norm and silu_and_mul and of
write_kv_reference, falling back to those torch versions for anything the kernels do not take:
another dtype, a layout that is not contiguous where the kernel needs it, or no compiled library
at all.

The C versions compute in float32 and round to the storage dtype where the torch ops round, so the
results are identical (the tests compare them bit for bit). The one exception: SiLU-and-multiply's
exp is a polynomial, not torch's, so its float32 results differ in the last bits (at most 5 ulp
over a dense sweep); in bfloat16 it gives torch's result for every gate value.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvpilot.engine.attention.torch_ref import write_kv_reference
from kvpilot.engine.cpu.build import SUFFIXES, load_library
from kvpilot.engine.model import layers
from kvpilot.engine.model.layer_ops import LayerOps


def kernels_take(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one dtype the kernels are built for, each with a contiguous last dimension."""
    first = tensors[0]
    dtype = first.dtype
    # is_cpu, not device.type (which builds a device object): this runs ~200 times per step.
    return (
        first.is_cpu
        and dtype in SUFFIXES
        and all(t.dtype == dtype and t.stride(-1) == 1 for t in tensors)
    )


def apply_rotary(
    lib: ctypes.CDLL | None,
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place, like the torch version: new contiguous [T, H, D] and [T, KVH, D]."""
    head_dim = query.shape[-1]
    if (
        lib is None
        or not kernels_take(query, key)
        or key.shape[0] != query.shape[0]
        or key.shape[2] != head_dim
        or positions.shape != query.shape[:1]
        or query.stride(1) != head_dim
        or key.stride(1) != head_dim
        or head_dim % 2
        or cos_sin_cache.dtype != torch.float32
        or not cos_sin_cache.is_contiguous()
        or positions.dtype != torch.int64
        or not positions.is_contiguous()
    ):
        return layers.apply_rotary(query, key, positions, cos_sin_cache)
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    out_of_table = getattr(lib, f"rotary_{SUFFIXES[query.dtype]}")(
        query.data_ptr(),
        key.data_ptr(),
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        len(cos_sin_cache),
        q_out.data_ptr(),
        k_out.data_ptr(),
        query.shape[0],
        query.shape[1],
        key.shape[1],
        head_dim,
        query.stride(0),
        key.stride(0),
    )
    if out_of_table:  # the kernel checks every position before it reads the table
        raise IndexError(f"rotary positions outside the table of {len(cos_sin_cache)} positions")
    return q_out, k_out


def write_kv(
    lib: ctypes.CDLL | None,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Each new token's key and value into its slot of the paged cache [blocks, block_size, KVH,
    D] (in place); IndexError for a slot outside the cache."""
    row = key.shape[1] * key.shape[2]
    if (
        lib is None
        or not kernels_take(key, value, k_cache, v_cache)
        # The C kernel trusts the shapes: anything inconsistent is the reference's to reject.
        or value.shape != key.shape
        or v_cache.shape != k_cache.shape
        or k_cache.shape[2:] != key.shape[1:]
        or slot_mapping.shape != key.shape[:1]
        or key.stride(1) != key.shape[2]
        or value.stride(1) != value.shape[2]
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
    ):
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping)
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    out_of_cache = getattr(lib, f"write_kv_{SUFFIXES[key.dtype]}")(
        key.data_ptr(),
        value.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        num_slots,
        key.shape[0],
        row,
        key.stride(0),
        value.stride(0),
    )
    if out_of_cache:  # checked in C before any write: a wrong slot must not write out of bounds
        raise IndexError(f"slot_mapping has slots outside the cache's {num_slots} slots")


def rms_norm(
    lib: ctypes.CDLL | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    serial_mean: bool = True,
    lanes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """layers.rms_norm, bit for bit. With `lanes` (torch_sum_lanes: the vector width with which
    the C sum adds in torch's order) one C call does it all; without, the C kernels do the
    elementwise passes and torch's own mean sums the squares between them.

    serial_mean: that mean runs on this thread alone. Each row is summed by one thread in the
    same order either way (identical results), and the whole mean is ~25-50 us at 2048 tokens,
    but an OpenMP region waits for its slowest thread: with another process on the cores, one
    descheduled thread held a 2-thread mean for milliseconds (mean 1.8 ms, p90 7.9 ms per call,
    61 calls per step; bench/RESULTS.md, "Engine core in its own process"). False: torch's
    parallel mean (bench A/B)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if (
        lib is None
        or x.dim() != 2
        or not kernels_take(*tensors)
        or not x.is_contiguous()
        or not weight.is_contiguous()
        or (residual is not None and not residual.is_contiguous())
        or weight.shape != (x.shape[1],)
        or (residual is not None and residual.shape != x.shape)
    ):
        return layers.rms_norm(x, weight, eps, residual)
    tokens, hidden = x.shape
    suffix = SUFFIXES[x.dtype]
    summed = x if residual is None else torch.empty_like(x)
    if lanes is not None and hidden >= lanes:
        out = torch.empty_like(x)
        failed = getattr(lib, f"rms_norm_fused_{suffix}")(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            summed.data_ptr(),
            weight.data_ptr(),
            eps,
            out.data_ptr(),
            tokens,
            hidden,
            lanes,
        )
        if not failed:
            return out, summed
    squares = torch.empty((tokens, hidden), dtype=torch.float32)
    getattr(lib, f"rms_norm_prepare_{suffix}")(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        summed.data_ptr(),
        squares.data_ptr(),
        tokens,
        hidden,
    )
    if serial_mean:
        threads = lib.kvpilot_set_openmp_threads(1)
        try:
            variance = squares.mean(-1)
        finally:
            lib.kvpilot_set_openmp_threads(threads)
    else:
        variance = squares.mean(-1)
    out = torch.empty_like(x)
    getattr(lib, f"rms_norm_apply_{suffix}")(
        summed.data_ptr(),
        variance.data_ptr(),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        tokens,
        hidden,
    )
    return out, summed


def silu_and_mul(lib: ctypes.CDLL | None, gate_up: torch.Tensor) -> torch.Tensor:
    """layers.silu_and_mul on a [tokens, 2 * inter] matrix with contiguous rows (the gate_up
    projection's output), in one pass; anything else goes to the torch version."""
    if (
        lib is None
        or not kernels_take(gate_up)
        or gate_up.dim() != 2
        or gate_up.shape[1] % 2
        or gate_up.stride(0) < gate_up.shape[1]
    ):
        return layers.silu_and_mul(gate_up)
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype)
    getattr(lib, f"silu_and_mul_{SUFFIXES[gate_up.dtype]}")(
        gate_up.data_ptr(), out.data_ptr(), tokens, inter, gate_up.stride(0)
    )
    return out


def argmax_rows(lib: ctypes.CDLL | None, values: torch.Tensor) -> torch.Tensor:
    """layers.argmax_rows (the same indices, NaN included) for float32 [R, V] rows with a
    contiguous last dimension, in C; anything else goes to the torch version."""
    if (
        lib is None
        or values.device.type != "cpu"
        or values.dtype != torch.float32
        or values.dim() != 2
        or values.shape[1] == 0
        or values.stride(1) != 1
    ):
        return layers.argmax_rows(values)
    out = torch.empty(values.shape[0], dtype=torch.int64)
    lib.argmax_rows_f32(
        values.data_ptr(), out.data_ptr(), values.shape[0], values.shape[1], values.stride(0)
    )
    return out


# Rows of the load-time check: lengths with and without a scalar tail, short and long enough for
# torch's cascade of partial sums to take a level step at every vector width.
_CHECK_LENGTHS = (576, 896, 1001, 2048, 4096, 5003, 8219)
_CHECK_ROWS = 8
# Vector widths (floats) to try: 8 first, what torch 2.13's sum kernel uses on AVX2 and, measured,
# on AVX-512 machines too.
_LANES_TO_TRY = (8, 16, 4)


@functools.cache
def torch_sum_lanes(lib: ctypes.CDLL) -> int | None:
    """The vector width with which the C sum (torch_order_sum) adds float32 rows exactly as
    torch's CPU sum does on this machine, checked bit for bit on rows whose sums depend on the
    order (random magnitudes over 12 binades, with and without a scalar tail, long enough for
    torch's cascade); None when no width matches (another torch version or dispatch): RMSNorm then
    keeps torch's own mean."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in _CHECK_LENGTHS:
        values = torch.rand(_CHECK_ROWS, n, generator=generator) + 0.5
        binades = torch.randint(-6, 6, (_CHECK_ROWS, n), generator=generator)
        rows.append(values * torch.exp2(binades))
    for lanes in _LANES_TO_TRY:
        if all(_sums_match(lib, row, lanes) for row in rows):
            return lanes
    return None


def _sums_match(lib: ctypes.CDLL, rows: torch.Tensor, lanes: int) -> bool:
    ours = torch.empty(rows.shape[0], dtype=torch.float32)
    lib.torch_order_sums(rows.data_ptr(), ours.data_ptr(), rows.shape[0], rows.shape[1], lanes)
    # The reference mean's own division too: layers.rms_norm takes torch's mean, not the sum.
    reference = rows.mean(-1)
    return torch.equal(ours / rows.shape[1], reference) and torch.equal(ours, rows.sum(-1))


def cpu_layer_ops() -> LayerOps:
    """The C versions bound to the compiled library (each falls back to torch by itself).

    RMSNorm sums the squares in torch's own order (torch_sum_lanes checks it at load; without a
    match it leaves the sum to torch's mean): a C sum in another order changed the float32 variance
    by an ulp, which bfloat16 rounding turned into different tokens on the real model (torch
    matches transformers bit for bit there). SiLU-and-multiply is one AVX-512 pass (a
    plain C loop the compiler left scalar lost to torch's; the explicit one does not)."""
    lib = load_library()
    if lib is None:
        return LayerOps()
    lanes = torch_sum_lanes(lib)
    return LayerOps(
        rms_norm=lambda x, weight, eps, residual=None: rms_norm(
            lib, x, weight, eps, residual, lanes=lanes
        ),
        silu_and_mul=lambda gate_up: silu_and_mul(lib, gate_up),
        apply_rotary=lambda q, k, positions, cache: apply_rotary(lib, q, k, positions, cache),
        argmax_rows=lambda values: argmax_rows(lib, values),
    )
