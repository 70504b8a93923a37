"""Other shapes of the Llama family, as tiny random transformers models saved as safetensors: Qwen2
(qkv bias, untied embeddings), Llama-3 rope scaling, GQA ratios 1, 3 and 4. Greedy token parity and
close logprobs against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams

from .reference import reference_greedy, save_tiny_hf_model

LOGPROB_ATOL = 1e-4  # fp32 on both sides, tiny matrices


def llama_config(heads: int, kv_heads: int, tied: bool = False, **extra: object) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=96 // heads,
        max_position_embeddings=512,
        initializer_range=0.15,  # peaky logits: greedy has no near-ties to flip
        tie_word_embeddings=tied,
        **extra,
    )


def qwen2_config() -> object:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=512,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )


SHAPES = {
    "llama-gqa1": lambda: llama_config(4, 4),
    "llama-gqa3": lambda: llama_config(6, 2),
    "llama-gqa4-tied": lambda: llama_config(8, 2, tied=True),
    "llama3-rope-scaling": lambda: llama_config(
        4,
        2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
    "qwen2-bias-untied": qwen2_config,
}


@pytest.mark.parametrize("name", list(SHAPES), ids=list(SHAPES))
def test_tiny_model_greedy_parity(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = save_tiny_hf_model(SHAPES[name](), tmp_path / name)
    ref_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    # Lengths cross block boundaries; one prompt is long enough for the scaled rope band to matter.
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 16, 37, 150)]
    refs = [reference_greedy(ref_model, p, 20) for p in prompts]

    llm = LLM(model=str(path), dtype="float32", block_size=16, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for out, ref in zip(outputs, refs, strict=True):
        ours = out.outputs[0]
        assert ours.token_ids == ref.token_ids[: len(ours.token_ids)]
        assert len(ours.token_ids) == 20
        for step, token in enumerate(ours.token_ids):
            assert abs(ours.logprobs[step][token].logprob - ref.logprobs[step]) < LOGPROB_ATOL
