"""The Triton LoRA shrink/expand kernels (engine/kernels/lora.py) against the float64 definition
(kvpilot.engine.lora.ops.add_lora_reference): small shapes under the interpreter, SmolLM2's
projection shapes compiled on a GPU (`-m gpu`).

Tolerances as for the C kernel: float32 within 1e-5 of the largest reference value; bfloat16
within one bfloat16 ulp of the reference per element (h is kept in float32 and the delta rounded
once, when it is added), almost every element identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kvpilot.engine.kernels.lora import add_lora_triton, block_tokens, triton_takes
from kvpilot.engine.lora.ops import add_lora, add_lora_reference, build_mapping

# Small: K = 48 (less than one 64-wide step), subs of 40, 16 and 16 rows (the first 64-column
# block straddles two subs), slots 1 and 3 of 4 used.
SMALL_K, SMALL_BOUNDS, NUM_SLOTS, USED = 48, (0, 40, 56, 72), 4, (1, 3)


def prepare(
    dtype: torch.dtype,
    rank: int,
    tokens: int,
    in_features: int,
    bounds: Sequence[int],
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """out, x, lora_a, lora_b on `device` and each token's slot: base tokens and USED slots mixed,
    the first token on an adapter, the second (when there is one) on the base model."""
    gen = torch.Generator().manual_seed(seed)
    num_sub, out_features = len(bounds) - 1, bounds[-1]
    lora_a = torch.randn(NUM_SLOTS, num_sub, rank, in_features, generator=gen) / in_features**0.5
    lora_b = torch.randn(NUM_SLOTS, out_features, rank, generator=gen) / rank**0.5
    x = torch.randn(tokens, in_features, generator=gen)
    out = torch.randn(tokens, out_features, generator=gen)
    choices = [-1, *USED]
    slots = [choices[int(i)] for i in torch.randint(len(choices), (tokens,), generator=gen)]
    slots[0] = USED[0]
    if tokens > 1:
        slots[1] = -1
    tensors = [t.to(dtype).to(device) for t in (out, x, lora_a, lora_b)]
    return tensors[0], tensors[1], tensors[2], tensors[3], slots


def check(actual: torch.Tensor, ref: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
        return
    _, exponent = torch.frexp(ref.float())
    ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32), exponent - 8)
    assert bool(((actual.float() - ref.float()).abs() <= ulp).all())
    assert (actual != ref).float().mean().item() < 0.02


def run_and_check(
    dtype: torch.dtype,
    rank: int,
    tokens: int,
    in_features: int,
    bounds: Sequence[int],
    device: torch.device | str = "cpu",
) -> None:
    out, x, lora_a, lora_b, slots = prepare(dtype, rank, tokens, in_features, bounds, device)
    token_slots = torch.tensor(slots, device=device)
    ref = out.cpu()
    add_lora_reference(ref, x.cpu(), lora_a.cpu(), lora_b.cpu(), bounds, token_slots.cpu())
    before = out.clone()
    add_lora_triton(out, x, lora_a, lora_b, bounds, token_slots)
    check(out.cpu(), ref)
    base = token_slots < 0
    assert torch.equal(out[base], before[base]), "a base-model token's output changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank, tokens", [(8, 1), (16, 5), (8, 20)])
def test_kernels_match_the_definition(dtype: torch.dtype, rank: int, tokens: int) -> None:
    """20 tokens: two tiles of 16, the second one partly past the end."""
    run_and_check(dtype, rank, tokens, SMALL_K, SMALL_BOUNDS)


def test_a_whole_tile_of_one_slot_and_a_k_loop() -> None:
    """A prefill-like run (tiles of 64 tokens), K over several 64-wide steps, four subs (the
    most the expand takes), one of them empty."""
    assert block_tokens(130) == 64
    run_and_check(torch.float32, 16, 130, 136, (0, 24, 24, 40, 56))


def test_an_all_base_batch_is_left_untouched() -> None:
    out, x, lora_a, lora_b, _ = prepare(torch.bfloat16, 8, 7, SMALL_K, SMALL_BOUNDS)
    before = out.clone()
    add_lora_triton(out, x, lora_a, lora_b, SMALL_BOUNDS, torch.full((7,), -1))
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))


def test_launcher_refuses_what_the_kernels_do_not_take() -> None:
    out, x, lora_a, lora_b, slots = prepare(torch.float32, 8, 4, SMALL_K, SMALL_BOUNDS)
    token_slots = torch.tensor(slots)
    assert triton_takes(out, x, lora_a, lora_b, SMALL_BOUNDS, token_slots)
    assert not triton_takes(out, x, lora_a, lora_b, (0, 40, 72), token_slots)
    assert not triton_takes(out, x.double(), lora_a, lora_b, SMALL_BOUNDS, token_slots)
    assert not triton_takes(out, x, lora_a, lora_b, SMALL_BOUNDS, token_slots.int())
    five = prepare(torch.float32, 8, 4, SMALL_K, (0, 8, 16, 24, 32, 72))
    assert not triton_takes(*five[:4], (0, 8, 16, 24, 32, 72), token_slots)  # subs above MAX_SUB
    with pytest.raises(ValueError, match="do not take"):
        add_lora_triton(out, x, lora_a.transpose(2, 3), lora_b, SMALL_BOUNDS, token_slots)


# SmolLM2-135M's projections: (in_features, bounds)
SMOLLM2 = ((576, (0, 576, 768, 960)), (576, (0, 576)), (576, (0, 1536, 3072)), (1536, (0, 576)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 64])
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_kernels_on_gpu_at_smollm2_shapes(
    dtype: torch.dtype, rank: int, tokens: int, cuda_device: torch.device
) -> None:
    for in_features, bounds in SMOLLM2:
        run_and_check(dtype, rank, tokens, in_features, bounds, cuda_device)


@pytest.mark.gpu
def test_add_lora_dispatches_cuda_tensors_to_the_kernels(cuda_device: torch.device) -> None:
    out, x, lora_a, lora_b, slots = prepare(torch.bfloat16, 16, 40, 576, (0, 576), cuda_device)
    expected = out.clone()
    add_lora_triton(expected, x, lora_a, lora_b, (0, 576), torch.tensor(slots, device=cuda_device))
    add_lora(out, x, lora_a, lora_b, (0, 576), build_mapping(slots, cuda_device))
    assert torch.equal(out, expected)
