"""Which slice of each weight a tensor-parallel rank holds: pure arithmetic on the model's shape.

Megatron-style: q/k/v and gate/up are split by output rows (column-parallel), o_proj and down_proj
by input columns (row-parallel, one all-reduce after each), the embedding and lm_head by vocab rows
(vocab-parallel, the vocab padded to a multiple of the size). Query heads split evenly; KV heads
split too when there are at least as many as ranks, and are replicated otherwise (with 3 KV heads
at size 6, ranks 0-1 hold head 0, ranks 2-3 head 1, ...), so each rank's query heads always find
their own KV head locally.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.contract.sizing import tensor_parallel_problem
from kvpilot.engine.config import ModelConfig, check_gpus_for_ranks


def check_tensor_parallel_size(cfg: ModelConfig, size: int, *, num_gpus: int | None = None) -> None:
    """ValueError, with the numbers, unless `size` ranks can split this model (and, on GPUs,
    each rank has one)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    check_gpus_for_ranks(size, num_gpus)
    problem = tensor_parallel_problem(
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, size
    )
    if problem is not None:
        raise ValueError(problem)


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` over a model of shape `cfg` (validated by check_tensor_parallel_size
    first)."""

    cfg: ModelConfig
    rank: int = 0
    size: int = 1

    @property
    def num_heads(self) -> int:
        return self.cfg.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.cfg.num_key_value_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        kv_heads = self.cfg.num_key_value_heads
        if kv_heads >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank * kv_heads // self.size  # replicated: size // kv_heads ranks per head

    @property
    def intermediate_size(self) -> int:
        return self.cfg.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.cfg.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """This rank's rows of the embedding/lm_head that exist in the checkpoint (the last rank's
        padding rows beyond the vocabulary stay zero)."""
        start = min(self.vocab_start, self.cfg.vocab_size)
        return start, min(start + self.vocab_per_rank, self.cfg.vocab_size)

    def source_slice(self, hf_name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the checkpoint tensor `hf_name` this rank reads, None for all of
        it (norms; everything at size 1)."""
        if self.size == 1:
            return None
        d = self.cfg.head_dim
        leaf = hf_name.rsplit(".", 2)
        module = leaf[-2] if len(leaf) >= 2 else ""
        if module == "q_proj":
            return 0, self.rank * self.num_heads * d, (self.rank + 1) * self.num_heads * d
        if module in ("k_proj", "v_proj"):
            start = self.kv_head_start * d
            return 0, start, start + self.num_kv_heads * d
        if module in ("gate_proj", "up_proj"):
            i = self.intermediate_size
            return 0, self.rank * i, (self.rank + 1) * i
        if module in ("o_proj", "down_proj") and hf_name.endswith(".weight"):
            width = self.num_heads * d if module == "o_proj" else self.intermediate_size
            return 1, self.rank * width, (self.rank + 1) * width
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (0, *self.vocab_rows)
        return None
