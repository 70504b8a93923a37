"""The models bundled with the engine (spec.model.uri builtin://NAME), with the shape the operator
checks a spec against without the model's files: the memory a CPU pod needs (operator/memory.py)
and the tensor-parallel sizes the model splits over (operator/spec.py). A test holds each shape
equal to the engine's own reading of the bundled model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    num_params: int
    num_layers: int
    num_heads: int  # attention (query) heads
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int  # the engine's max_model_len when the spec sets none


# builtin://NAME -> its shape.
BUILTIN_MODELS: dict[str, ModelShape] = {
    "smollm2-135m-instruct": ModelShape(
        num_params=134_515_008,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        hidden_size=576,
        intermediate_size=1536,
        vocab_size=49_152,
        max_position_embeddings=8192,
    ),
}
