"""transformers as the reference: the same GGUF (or HF dir) loaded by transformers, generated
greedily."""

from __future__ import annotations

import os
from copy import deepcopy
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
from kvpilot.engine.model.loader import bundled_gguf_path

CHAT_QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip, briefly.",
    "Explain in two sentences why the sky looks blue during the day but red at sunset.",
    "You are a travel agent. A customer wants a quiet week in the mountains in October, with good "
    "food, short hikes and no car. Suggest a region and a rough plan for the week.",
    "Translate to French: 'The library opens at nine and closes at six on weekdays.'",
    "Summarize the plot of Romeo and Juliet for a ten-year-old, in a friendly tone, keeping it "
    "under five sentences, and mention what lesson the story teaches about rushing decisions "
    "and family feuds.",
]


@dataclass(frozen=True)
class ReferenceOutput:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each generated token under the reference
    top5: list[list[int]]  # reference's top-5 token ids at each step
    top5_logprobs: list[list[float]]  # and their logprobs


@cache
def smollm2_tokenizer() -> object:
    """transformers' tokenizer of the bundled GGUF, as the engine's GGUF cache holds it (saved by
    transformers from the same GGUF conversion). Converting the GGUF's vocabulary takes a minute
    on a loaded 2-core machine, and the cache is filled by the first engine that loads the model,
    so this reads it rather than convert again. The tokenizer only makes the prompts' ids, which
    both sides of a parity test are given."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_to_hf_dir(bundled_gguf_path())))


@cache
def smollm2_reference(dtype: torch.dtype = torch.float32) -> tuple[object, object]:
    """transformers' model of the bundled GGUF in dtype, and its tokenizer. transformers
    dequantizes a GGUF to float32 and casts each weight to dtype as it loads it, so another dtype
    is the float32 model with its parameters cast (its buffers, such as the rotary frequencies,
    stay as transformers builds them): the same model without a second dequantization."""
    if dtype != torch.float32:
        return with_parameters_cast(smollm2_reference()[0], dtype), smollm2_tokenizer()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    path = bundled_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval(), smollm2_tokenizer()


def with_parameters_cast(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of model whose parameters are in dtype; its buffers keep their dtype (tied
    parameters stay tied: each is one Parameter, cast once)."""
    copy = deepcopy(model)
    for param in copy.parameters():
        param.data = param.data.to(dtype)
    copy.config.dtype = dtype
    return copy.eval()


def chat_prompt_ids(tokenizer: object, questions: list[str]) -> list[list[int]]:
    ids = []
    for q in questions:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


@torch.inference_mode()
def reference_greedy(model: object, prompt_ids: list[int], max_new_tokens: int) -> ReferenceOutput:
    """One prompt alone (no padding), greedy, with the reference's own logprobs."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=model.generation_config.eos_token_id,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs, top5, top5_logprobs = [], [], []
    for step, logits in enumerate(out.logits):
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        logprobs.append(float(lp[tokens[step]]))
        best = torch.topk(lp, 5)
        top5.append(best.indices.tolist())
        top5_logprobs.append(best.values.tolist())
    return ReferenceOutput(tokens, logprobs, top5, top5_logprobs)


def save_tiny_hf_model(config: object, path: Path, seed: int = 0) -> Path:
    """A tiny random transformers model saved as safetensors, for shapes the demo model lacks."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    return path
