"""The engine with every Triton kernel selected (attention, KV write, RMSNorm, rotary, SiLU) against
transformers' greedy generate, token for token, under the interpreter.

The model is a tiny random Llama saved with save_pretrained (safetensors, a word-level tokenizer),
so the interpreter's per-program Python loop stays affordable. Its shape still has the features that
break kernels: GQA with a group of 3 (as SmolLM2-135M), several prompts of different lengths in one
batch, a prefill chunked across steps (chunks attending to a cached prefix that ends mid-block) and
decodes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams

VOCAB_SIZE = 96
MAX_NEW_TOKENS = 10
PROMPT_LENS = (5, 21, 38)  # 38 > max_num_batched_tokens: its prefill runs in chunks
EXPECTED_KERNELS = {
    "_paged_attention_kernel",
    "_write_kv_kernel",
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_silu_and_mul_kernel",
}


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        # Wide logits, so that greedy choices are far from ties that float noise could flip.
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(VOCAB_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(path)
    return path


def reference_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                min_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_triton_engine_matches_transformers_greedy(
    tiny_llama_dir: Path, triton_launches: Counter[str]
) -> None:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    expected = reference_greedy(tiny_llama_dir, prompts)
    triton_launches.clear()  # what the engine under test launches, from here on
    launches = triton_launches

    llm = LLM(
        model=str(tiny_llama_dir),
        attention_backend="triton",
        dtype="float32",
        device="cpu",
        block_size=16,
        num_blocks=16,
        max_num_batched_tokens=24,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)

    got = [out.outputs[0].token_ids for out in outputs]
    assert got == expected
    # Alone, a prompt decodes in one-token steps (the single-stream case).
    alone = llm.generate([prompts[1]], params)[0]
    assert alone.outputs[0].token_ids == expected[1]
    # Every kernel really ran (none fell back to torch), once per layer and step at least.
    assert set(launches) == EXPECTED_KERNELS
    assert launches["_paged_attention_kernel"] >= 2 * MAX_NEW_TOKENS
