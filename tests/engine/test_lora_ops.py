"""The batched LoRA delta on CPU: the C kernel (engine/cpu/csrc/lora.c) and the segmented torch path
against the float64 definition (add_lora_reference), over mixed batches of base-model tokens and
several adapter slots, and add_lora's choice between them.

Tolerances: float32 within 1e-5 of the largest reference value (float32 sums over K + rank terms
against float64); bfloat16 within one bfloat16 ulp of the reference per element (the kernel rounds
its float32 sum once, so it can land on the other neighbour of the exact value, never further),
with almost every element identical.
"""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Sequence
from itertools import pairwise

import pytest
import torch

from kvpilot.engine.cpu import build
from kvpilot.engine.cpu import lora as cpu_lora
from kvpilot.engine.cpu.build import load_library
from kvpilot.engine.lora.ops import (
    add_lora,
    add_lora_reference,
    add_lora_torch,
    build_mapping,
)

LIB = load_library()
needs_lib = pytest.mark.skipif(LIB is None, reason="no C compiler: the CPU kernels are not built")

# A qkv-like projection, scaled down: subs of 128, 40 and 40 rows (40: an expand block of 64
# columns straddles two subs), K = 96.
IN_FEATURES = 96
BOUNDS = (0, 128, 168, 208)
NUM_SLOTS = 7
USED_SLOTS = (1, 4, 6)  # non-contiguous ids; the others hold adapters no token uses


def prepare(
    dtype: torch.dtype,
    rank: int,
    tokens: int,
    *,
    bounds: Sequence[int] = BOUNDS,
    seed: int = 0,
    used: Sequence[int] = USED_SLOTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """out, x, lora_a, lora_b, and each token's slot: base tokens and the used slots mixed in a
    random order (the first token always has an adapter, the second, when there is one, none)."""
    gen = torch.Generator().manual_seed(seed)
    num_sub, out_features = len(bounds) - 1, bounds[-1]
    lora_a = torch.randn(NUM_SLOTS, num_sub, rank, IN_FEATURES, generator=gen) / IN_FEATURES**0.5
    lora_b = torch.randn(NUM_SLOTS, out_features, rank, generator=gen) / rank**0.5
    x = torch.randn(tokens, IN_FEATURES, generator=gen)
    out = torch.randn(tokens, out_features, generator=gen)
    choices = [-1, *used]
    slots = [choices[int(i)] for i in torch.randint(len(choices), (tokens,), generator=gen)]
    slots[0] = used[0]
    if tokens > 1:
        slots[1] = -1
    return out.to(dtype), x.to(dtype), lora_a.to(dtype), lora_b.to(dtype), slots


def expected(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: list[int],
    bounds: Sequence[int] = BOUNDS,
) -> torch.Tensor:
    ref = out.clone()
    add_lora_reference(ref, x, lora_a, lora_b, bounds, torch.tensor(slots))
    return ref


def bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at each value (8 significant bits)."""
    _, exponent = torch.frexp(values.float())
    return torch.ldexp(torch.ones_like(values, dtype=torch.float32), exponent - 8)


def assert_matches_reference(actual: torch.Tensor, ref: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        scale = ref.abs().max().item()
        torch.testing.assert_close(actual, ref, rtol=0, atol=1e-5 * scale)
        return
    diff = (actual.float() - ref.float()).abs()
    assert bool((diff <= bf16_ulp(ref)).all()), f"{int((diff > bf16_ulp(ref)).sum())} beyond 1 ulp"
    assert (actual != ref).float().mean().item() < 0.02  # one rounding: neighbours are rare


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_c_kernel_matches_the_definition(dtype: torch.dtype, rank: int, tokens: int) -> None:
    out, x, lora_a, lora_b, slots = prepare(dtype, rank, tokens, seed=rank + tokens)
    mapping = build_mapping(slots)
    ref = expected(out, x, lora_a, lora_b, slots)
    assert cpu_lora.kernel_takes(out, x, lora_a, lora_b, BOUNDS, mapping.token_slots)
    before = out.clone()
    add_lora(out, x, lora_a, lora_b, BOUNDS, mapping)
    assert_matches_reference(out, ref)
    base = torch.tensor(slots) < 0
    assert torch.equal(out[base], before[base]), "a base-model token's output changed"
    assert not torch.equal(out[~base], before[~base]), "no delta was added"


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_leaves_an_all_base_batch_untouched(dtype: torch.dtype) -> None:
    assert LIB is not None
    out, x, lora_a, lora_b, _ = prepare(dtype, 16, 9)
    before = out.clone()
    slots = torch.full((9,), -1, dtype=torch.int64)
    assert cpu_lora.add_lora(LIB, out, x, lora_a, lora_b, BOUNDS, slots)  # the kernel itself
    add_lora(out, x, lora_a, lora_b, BOUNDS, build_mapping([-1] * 9))  # and the dispatcher
    assert torch.equal(
        out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        before.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )


@needs_lib
def test_c_kernel_refuses_a_slot_outside_the_stack() -> None:
    assert LIB is not None
    out, x, lora_a, lora_b, _ = prepare(torch.float32, 16, 4)
    before = out.clone()
    slots = torch.tensor([1, -1, NUM_SLOTS, 4])
    with pytest.raises(IndexError, match=f"stack of {NUM_SLOTS} slots"):
        cpu_lora.add_lora(LIB, out, x, lora_a, lora_b, BOUNDS, slots)
    assert torch.equal(out, before)


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_gives_the_same_bits_with_any_thread_count(dtype: torch.dtype) -> None:
    """Each sum runs in one order whichever thread computes it."""
    out, x, lora_a, lora_b, slots = prepare(dtype, 16, 300, seed=3)
    mapping = build_mapping(slots)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 5):
            torch.set_num_threads(threads)
            result = out.clone()
            add_lora(result, x, lora_a, lora_b, BOUNDS, mapping)
            results.append(result)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results[1:])


@needs_lib
def test_c_kernel_reads_and_writes_strided_rows() -> None:
    """x and out as column slices of wider buffers (row strides above K and N), as a projection
    slicing a fused output would hand them over."""
    out, x, lora_a, lora_b, slots = prepare(torch.float32, 16, 33, seed=5)
    ref = expected(out, x, lora_a, lora_b, slots)
    wide_x = torch.zeros(33, IN_FEATURES + 24)
    wide_x[:, 8 : 8 + IN_FEATURES] = x
    wide_out = torch.full((33, BOUNDS[-1] + 40), 7.0)
    wide_out[:, 16 : 16 + BOUNDS[-1]] = out
    x_view, out_view = wide_x[:, 8 : 8 + IN_FEATURES], wide_out[:, 16 : 16 + BOUNDS[-1]]
    mapping = build_mapping(slots)
    assert cpu_lora.kernel_takes(out_view, x_view, lora_a, lora_b, BOUNDS, mapping.token_slots)
    add_lora(out_view, x_view, lora_a, lora_b, BOUNDS, mapping)
    assert_matches_reference(out_view, ref)
    assert bool((wide_out[:, :16] == 7).all() and (wide_out[:, 16 + BOUNDS[-1] :] == 7).all())


@needs_lib
def test_kernel_takes_only_its_layout() -> None:
    assert LIB is not None
    out, x, lora_a, lora_b, slots = prepare(torch.float32, 16, 5)
    token_slots = torch.tensor(slots)
    assert cpu_lora.kernel_takes(out, x, lora_a, lora_b, BOUNDS, token_slots)
    odd_rank = prepare(torch.float32, 12, 5)
    assert not cpu_lora.kernel_takes(*odd_rank[:4], BOUNDS, token_slots)
    assert not cpu_lora.kernel_takes(out, x, lora_a, lora_b, (0, 128, 164, 208), token_slots)
    assert not cpu_lora.kernel_takes(out, x, lora_a, lora_b, (0, 128, 208), token_slots)
    half = [t.half() for t in (out, x, lora_a, lora_b)]
    assert not cpu_lora.kernel_takes(*half, BOUNDS, token_slots)
    assert not cpu_lora.kernel_takes(
        out, x.t().contiguous().t(), lora_a, lora_b, BOUNDS, token_slots
    )
    assert not cpu_lora.kernel_takes(out, x, lora_a, lora_b, BOUNDS, token_slots.int())
    assert not cpu_lora.kernel_takes(out[0], x, lora_a, lora_b, BOUNDS, token_slots)
    assert not cpu_lora.kernel_takes(out, x[:4], lora_a, lora_b, BOUNDS, token_slots)
    overlapping = out.as_strided(out.shape, (8, 1))  # rows 8 apart, 208 wide
    assert not cpu_lora.kernel_takes(overlapping, x, lora_a, lora_b, BOUNDS, token_slots)
    assert not cpu_lora.add_lora(LIB, overlapping, x, lora_a, lora_b, BOUNDS, token_slots)


@pytest.mark.parametrize(
    "dtype, rank, bounds",
    [
        (torch.float32, 12, BOUNDS),  # a rank the vector path does not take
        (torch.float16, 16, BOUNDS),  # a dtype the library is not built for
        (torch.float32, 16, (0, 128, 164, 208)),  # a sub boundary off the 8-lane grid
    ],
)
def test_what_the_kernel_does_not_take_goes_the_torch_way(
    dtype: torch.dtype, rank: int, bounds: tuple[int, ...]
) -> None:
    out, x, lora_a, lora_b, slots = prepare(dtype, rank, 20, bounds=bounds)
    ref = expected(out, x, lora_a, lora_b, slots, bounds)
    add_lora(out, x, lora_a, lora_b, bounds, build_mapping(slots))
    atol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out, ref, rtol=0, atol=atol * ref.abs().max().item())


def delta_magnitude(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    """Per output element, sum_r |B[n, r]| |h_r| in float64: the scale of the terms of its delta."""
    mag = torch.zeros(len(slots), BOUNDS[-1], dtype=torch.float64)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        for i, (lo, hi) in enumerate(pairwise(BOUNDS)):
            h = lora_a[slot, i].double() @ x[t].double()
            mag[t, lo:hi] = lora_b[slot, lo:hi].double().abs() @ h.abs()
    return mag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64])
def test_torch_path_matches_the_definition(dtype: torch.dtype, tokens: int) -> None:
    """The torch path rounds h and the delta to the storage dtype (its matmuls' outputs) before
    the rounded add: in bfloat16 each of those two roundings may move the result by 2^-8 of the
    delta's term scale, so it is held to one output ulp plus twice that (a 2x margin), not to one
    ulp as the kernel is."""
    out, x, lora_a, lora_b, slots = prepare(dtype, 16, tokens, seed=11)
    ref = expected(out, x, lora_a, lora_b, slots)
    add_lora_torch(out, x, lora_a, lora_b, BOUNDS, build_mapping(slots))
    if dtype == torch.float32:
        assert_matches_reference(out, ref)
        return
    bound = bf16_ulp(ref).double() + 2**-6 * delta_magnitude(x, lora_a, lora_b, slots)
    assert bool(((out.double() - ref.double()).abs() <= bound).all())


@pytest.fixture(scope="module")
def plain_c_library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """lora.c alone, built with -mno-avx2: the loops that CPUs without AVX2 run (alone, so that
    this takes a fraction of a second, not a build of every kernel)."""
    compiler = build.c_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    target = tmp_path_factory.mktemp("lora_plain") / "lora.so"
    source = build.CSRC / "lora.c"
    flags = [*build.BASE_FLAGS, "-mno-avx2", "-fopenmp"]
    subprocess.run([compiler, *flags, str(source), "-o", str(target)], check=True, timeout=120)
    lib = ctypes.CDLL(str(target))
    for suffix in build.SUFFIXES.values():
        fn = getattr(lib, f"lora_add_{suffix}")
        fn.argtypes, fn.restype = build.signatures()[f"lora_add_{suffix}"]
    return lib


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_c_loops_match_the_definition(
    dtype: torch.dtype, plain_c_library: ctypes.CDLL
) -> None:
    out, x, lora_a, lora_b, slots = prepare(dtype, 16, 37, seed=2)
    ref = expected(out, x, lora_a, lora_b, slots)
    token_slots = torch.tensor(slots)
    assert cpu_lora.add_lora(plain_c_library, out, x, lora_a, lora_b, BOUNDS, token_slots)
    assert_matches_reference(out, ref)
