"""The engine on an FP8 KV cache with every Triton kernel selected, under the interpreter, against
the engine on the torch reference backend over the same FP8 cache: the same greedy tokens.

Both read one checkpoint with per-head k/v scales, so the two caches hold the same codes and
differ only in how attention sums them (the kernel dots the codes and scales in float32, the
reference dequantizes first). A tiny random Llama (GQA group 3, the SmolLM2-135M ratio) keeps the
interpreter's per-program loop to seconds; a prompt longer than max_num_batched_tokens runs its
prefill in chunks over a cached FP8 prefix that ends mid-block.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpilot.engine import LLM, SamplingParams
from tests.engine.reference import save_tiny_hf_model
from tests.engine.test_parity_tiny_models import llama_config

NUM_LAYERS, NUM_KV_HEADS = 2, 2
PROMPT_LENS = (5, 19)  # 19 > max_num_batched_tokens: chunked prefill
MAX_NEW_TOKENS = 4


@pytest.fixture(scope="module")
def fp8_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose checkpoint carries per-head scales that differ 3x between the
    heads (calibration would be skipped, and both backends read the same scales)."""
    path = save_tiny_hf_model(llama_config(6, NUM_KV_HEADS), tmp_path_factory.mktemp("llama"))
    weights = load_file(str(path / "model.safetensors"))
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}.self_attn"
        weights[f"{prefix}.k_scale"] = torch.tensor([0.01, 0.03])
        weights[f"{prefix}.v_scale"] = torch.tensor([0.004, 0.012])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def greedy_on(model_dir: Path, backend: str, prompts: list[list[int]]) -> tuple[Any, ...]:
    """(greedy tokens per prompt, the pool's K cache of layer 0, the pool's scales)."""
    with LLM(
        model=str(model_dir),
        attention_backend=backend,
        kv_cache_dtype="fp8",
        dtype="float32",
        device="cpu",
        block_size=16,
        num_blocks=16,
        max_num_batched_tokens=12,
    ) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        pool = llm.engine.runner.kv_pool
        return tokens, pool.layers[0][0].clone(), [s.clone() for pair in pool.scales for s in pair]


def test_triton_fp8_engine_gives_the_torch_reference_fp8_greedy_tokens(
    fp8_llama_dir: Path, triton_launches: Counter[str]
) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    reference, ref_cache, ref_scales = greedy_on(fp8_llama_dir, "torch", prompts)
    triton_launches.clear()  # what the engine under test launches, from here on
    launches = triton_launches

    got, cache, scales = greedy_on(fp8_llama_dir, "triton", prompts)

    assert got == reference
    # Not trivially equal: each prompt's output has more than one distinct token.
    assert all(len(set(tokens)) > 1 for tokens in reference), reference
    # The cache really is one byte per element, with codes written, and the checkpoint's scales.
    assert cache.dtype == ref_cache.dtype == torch.float8_e4m3fn and cache.element_size() == 1
    assert int((cache.view(torch.uint8) != 0).sum()) > 0
    expected_scales = [torch.tensor(s) for s in ([0.01, 0.03], [0.004, 0.012])] * NUM_LAYERS
    for got_scale, ref_scale, want in zip(scales, ref_scales, expected_scales, strict=True):
        torch.testing.assert_close(got_scale, want)
        torch.testing.assert_close(ref_scale, want)
    # The Triton attention and KV write ran on it, every step (none fell back to torch).
    assert launches["_paged_attention_kernel"] >= NUM_LAYERS * MAX_NEW_TOKENS
    assert launches["_write_kv_kernel"] >= NUM_LAYERS * MAX_NEW_TOKENS
