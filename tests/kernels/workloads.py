"""Models and workloads the kernel tests share (imported as tests.kernels.workloads)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

# A small Llama with 2 KV heads: few enough programs that even long chunks split (see
# attention.eager_passes); the no-compile tests run it on a GPU and its schedule on the CPU.
TINY_GQA_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


# A 2-layer, 64-wide Llama: a forward that costs little, so a step's time is mostly host work.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def varied_rounds(seed: int = 5, rounds: int = 3) -> Iterator[tuple[list[list[int]], list[int]]]:
    """Rounds of 8-59 prompts of 3-899 tokens (more than two 2048-token steps' worth each), 1-39
    outputs: batches, table widths and chunk mixes that differ from round to round."""
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        lens = rng.integers(3, 900, size=int(rng.integers(8, 60)))
        assert lens.sum() > 2 * 2048
        prompts = [rng.integers(1, 999, n).tolist() for n in lens]
        yield prompts, rng.integers(1, 40, size=len(prompts)).tolist()
