"""PEFT, the reference for adapters: LoRA adapters made with it on a base model (B non-zero, so the
adapter changes the output), saved in PEFT's format, and greedy generation through PEFT and through
the merged weights."""

from __future__ import annotations

from pathlib import Path

import torch

from .reference import ReferenceOutput, reference_greedy

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int,
    seed: int,
    targets: list[str] | None = None,
    alpha: float | None = None,
    use_rslora: bool = False,
    scale: float = 0.2,
) -> Path:
    """A LoRA adapter of `base_dir` with random A and B (std `scale` / sqrt(fan-in)), saved by
    PEFT into `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=targets or ALL_TARGETS,
        lora_dropout=0.0,
        use_rslora=use_rslora,
        init_lora_weights=False,  # random A and B: B non-zero
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=generator) * scale / fan_in**0.5)
    model.save_pretrained(str(out_dir))
    return out_dir


def peft_model(base_dir: Path, adapter_dir: Path, dtype: torch.dtype = torch.float32) -> object:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def peft_greedy(model: object, prompt_ids: list[int], max_new_tokens: int) -> ReferenceOutput:
    return reference_greedy(model, prompt_ids, max_new_tokens)


class PeftReferences:
    """The base model loaded once with every adapter beside it (PEFT's multi-adapter model):
    greedy(name, ...) runs one adapter, or the base model with name None."""

    def __init__(self, base_dir: Path, adapters: dict[str, Path]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        first, *rest = adapters
        self.model = PeftModel.from_pretrained(base, str(adapters[first]), adapter_name=first)
        for name in rest:
            self.model.load_adapter(str(adapters[name]), adapter_name=name)
        self.model.eval()

    def greedy(self, name: str | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        if name is None:
            with self.model.disable_adapter():
                return reference_greedy(self.model, prompt_ids, max_new_tokens).token_ids
        self.model.set_adapter(name)
        return reference_greedy(self.model, prompt_ids, max_new_tokens).token_ids


def merged_dir(base_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """The base model with the adapter merged into its weights, saved as a plain HF model."""
    model = peft_model(base_dir, adapter_dir).merge_and_unload()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir
