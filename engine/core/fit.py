"""Whether a prompt fits the model's context and the KV pool: checked by the engine core and, before
a request is sent to it, by the API process (which imports no torch, hence its own module)."""

from __future__ import annotations


def check_prompt_fits(
    num_tokens: int, *, max_model_len: int, num_blocks: int, block_size: int
) -> None:
    """The length half of check_prompt (the API side has checked the ids while preprocessing)."""
    if num_tokens == 0:
        raise ValueError("the prompt is empty")
    if num_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {num_tokens} tokens, but this model's context is {max_model_len} "
            "tokens, including at least one generated token"
        )
    if num_tokens >= num_blocks * block_size:
        raise ValueError(
            f"the prompt has {num_tokens} tokens, but the whole KV cache holds "
            f"{num_blocks * block_size} tokens ({num_blocks} blocks of {block_size})"
        )
