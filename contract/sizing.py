"""Arithmetic on a model's shape that the engine and the operator must compute alike: the memory
a CPU engine needs (the engine refuses to start above its container's limit; the operator refuses
a limit the engine would refuse) and the tensor-parallel sizes a model can be split over (the
engine refuses any other before it starts a rank; the operator refuses it in the spec).
Pure and torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

# What the processes of `kvpilot serve` hold besides weights, KV cache and activations: the Python
# runtimes and torch in the API process, the engine core and the big-body worker, the tokenizer
# copies, oneDNN's packed weights and allocator slack. Measured with bench/example_memory.py
# (bench/RESULTS.md): SmolLM2 float32, 768 MiB KV, under its example's maximum load: 3005 MiB of
# process peaks = 513 weights + 768 KV + 58 activations + 1666 of this.
RUNTIME_BYTES = 1700 * 2**20


@dataclass(frozen=True)
class MemoryNeed:
    """What an engine holds in RAM at its peak, in bytes, by part."""

    weights: int
    kv_cache: int
    working: int  # runtime + activations
    adapters: int = 0  # LoRA adapters: their slots and the ones kept read in host memory
    draft: int = 0  # a speculative draft model: its weights and its own KV cache

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.working + self.adapters + self.draft


def lora_bytes(
    *, num_layers: int, hidden_size: int, q_size: int, kv_size: int, intermediate_size: int,
    max_rank: int, max_loras: int, max_cpu_loras: int, itemsize: int,
) -> int:  # fmt: skip
    """The most LoRA adapters take: max_loras slots at the model's `itemsize` plus max_cpu_loras
    adapters read in host memory (float32), each of rank max_rank on all seven projections. One
    adapter's A and B of one layer hold rank x (in + out) numbers per projection."""
    per_rank = (
        3 * hidden_size  # q, k, v: A is rank x hidden
        + q_size
        + 2 * kv_size  # their B rows
        + q_size
        + hidden_size  # o: A over the heads' width, B over hidden
        + 2 * (hidden_size + intermediate_size)  # gate, up
        + intermediate_size
        + hidden_size  # down
    )
    one_adapter = num_layers * max_rank * per_rank
    return one_adapter * (max_loras * itemsize + max_cpu_loras * 4)


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V one token holds in the KV cache, over all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


def kv_cache_tokens(*, kv_cache_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Tokens a KV budget holds on one rank: whole blocks only."""
    return kv_cache_bytes // (kv_bytes_per_token * block_size) * block_size


def draft_kv_tokens(
    *, target_kv_tokens: int, max_seq_len: int, max_speculating_seqs: int, block_size: int
) -> int:
    """Tokens the draft model's own KV cache holds, in whole blocks (one at least): as many as
    the target's pool, or max_speculating_seqs (disable_by_batch_size: past it no sequence
    speculates) sequences of max_seq_len (the engine's longest sequence) where that is fewer."""
    tokens = min(target_kv_tokens, max_speculating_seqs * max_seq_len)
    return max(1, -(-tokens // block_size)) * block_size


def draft_model_bytes(
    *, num_params: int, num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int,
    kv_tokens: int,
) -> int:  # fmt: skip
    """A draft model's weights and its KV cache of kv_tokens tokens (draft_kv_tokens), both at
    the engine's dtype (the draft's cache is never FP8)."""
    per_token = kv_bytes_per_token(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, itemsize=itemsize
    )
    return num_params * itemsize + kv_tokens * per_token


def activation_bytes(
    *, max_num_batched_tokens: int, max_num_seqs: int, hidden_size: int,
    intermediate_size: int, vocab_size: int, itemsize: int,
) -> int:  # fmt: skip
    """A step's transient tensors: a few hidden-size and MLP-size rows per scheduled token, and
    float32 logits (a few copies while sampling) per sequence."""
    per_token = (4 * hidden_size + 3 * intermediate_size) * itemsize
    return max_num_batched_tokens * per_token + 3 * max_num_seqs * vocab_size * 4


def cpu_memory_need(
    *, num_params: int, hidden_size: int, intermediate_size: int, vocab_size: int,
    itemsize: int, kv_cache_bytes: int, max_num_batched_tokens: int, max_num_seqs: int,
) -> MemoryNeed:  # fmt: skip
    """What a CPU engine holds in RAM at its peak, all its processes together: the weights at
    `itemsize` bytes each, the KV cache's budget, and the runtime plus one step's activations."""
    working = RUNTIME_BYTES + activation_bytes(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        itemsize=itemsize,
    )
    return MemoryNeed(weights=num_params * itemsize, kv_cache=kv_cache_bytes, working=working)


def tensor_parallel_problem(
    num_heads: int, num_kv_heads: int, intermediate_size: int, size: int
) -> str | None:
    """Why `size` ranks (>= 1) cannot split a model of this shape, or None. Each rank takes an
    equal share of the attention heads and of the MLP; the KV heads are split evenly when there
    are at least as many as ranks, and replicated evenly otherwise."""
    if num_heads % size:
        return (
            f"tensor_parallel_size {size} does not divide the model's {num_heads} attention heads"
        )
    if num_kv_heads >= size and num_kv_heads % size:
        return f"tensor_parallel_size {size} does not divide the model's {num_kv_heads} KV heads"
    if num_kv_heads < size and size % num_kv_heads:
        return (
            f"tensor_parallel_size {size} is not a multiple of the model's {num_kv_heads} KV "
            "heads (needed to replicate them)"
        )
    if intermediate_size % size:
        return (
            f"tensor_parallel_size {size} does not divide the model's intermediate size "
            f"{intermediate_size}"
        )
    return None


def tensor_parallel_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    """Every size such a model can be split over, ascending."""
    return [
        size
        for size in range(1, num_heads + 1)
        if tensor_parallel_problem(num_heads, num_kv_heads, intermediate_size, size) is None
    ]
