"""A tiny random Llama and PEFT LoRA adapters for it, written to this machine's disk: what the
e2e tests load into engines where the model's answers do not matter (the stand-ins run the
engines here, so file:// URIs reach them)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LORA_RANK = 8


@dataclass(frozen=True)
class LoraModels:
    base: Path
    sql: Path  # q_proj and v_proj
    chat: Path  # the default targets
    broken: Path  # a valid adapter config beside weights that are no safetensors file


@contextlib.contextmanager
def lora_models_for_pods() -> Iterator[LoraModels]:
    """The models in a directory the stand-in's engine pods see at the same path: not under
    /tmp, where the engine pods mount an emptyDir that hides the host's /tmp (as it would the
    image's). Removed afterwards."""
    parent = Path.home() / ".cache" / "kvpilot-e2e"
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="lora-models-", dir=parent))
    try:
        yield make_lora_models(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def make_lora_models(root: Path) -> LoraModels:
    from transformers import LlamaConfig

    from tests.engine.lora_reference import make_peft_adapter
    from tests.engine.reference import save_tiny_hf_model

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    base = save_tiny_hf_model(config, root / "base")
    sql = make_peft_adapter(
        base, root / "sql", rank=LORA_RANK, seed=1, targets=["q_proj", "v_proj"]
    )
    chat = make_peft_adapter(base, root / "chat", rank=LORA_RANK, seed=2)
    broken = shutil.copytree(sql, root / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"these bytes are no safetensors file")
    return LoraModels(base, sql, chat, broken)


def tiny_lora_spec(models: LoraModels, max_loras: int) -> dict[str, Any]:
    """An InferenceService spec serving the tiny base with LoRA on, one replica, no adapter
    yet (spec.adapters is the caller's)."""
    return {
        "model": {"uri": f"file://{models.base}"},
        "replicas": 1,
        "engine": {
            "lora": {"maxLoras": max_loras, "maxLoraRank": LORA_RANK},
            "kvCacheBytes": "16Mi",
        },
    }
