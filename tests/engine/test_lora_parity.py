"""LoRA adapters against PEFT, the reference: greedy tokens identical to transformers + PEFT with
the same adapter, for one batch mixing the base model and three adapters (ranks 8 and 64, all
targets and a subset, rsLoRA), with chunked prefill; equal to the adapter merged into the weights;
and a prefix shared across adapters never served from another adapter's (or the base model's) KV.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import LoRAConfig

from .lora_reference import PeftReferences, make_peft_adapter, merged_dir, peft_greedy, peft_model
from .reference import reference_greedy, save_tiny_hf_model
from .test_parity_tiny_models import llama_config

NEW_TOKENS = 12
ADAPTERS = {
    "rank8": dict(rank=8, seed=1),
    "rank64": dict(rank=64, seed=2),
    "qv-rslora": dict(rank=8, seed=3, targets=["q_proj", "v_proj"], use_rslora=True, alpha=4.0),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_hf_model(llama_config(6, 2), root / "base")
    adapters = {
        name: make_peft_adapter(base, root / name, **spec) for name, spec in ADAPTERS.items()
    }
    return base, adapters


def prompts() -> list[list[int]]:
    shared = [(7 * i + 3) % 500 for i in range(24)]  # a prefix every prompt starts with
    return [shared + [(11 * i + j) % 500 for i in range(5 + 3 * j)] for j in range(8)]


def engine(base: Path, adapters: dict[str, Path], **kwargs: object) -> LLM:
    lora = LoRAConfig(
        max_loras=3, max_lora_rank=64, modules=tuple((n, str(p)) for n, p in adapters.items())
    )
    return LLM(str(base), lora=lora, block_size=16, **kwargs)


def test_one_batch_of_base_and_three_adapters_follows_peft_token_for_token(
    models: tuple[Path, dict[str, Path]],
) -> None:
    base, adapters = models
    names = [None, "rank8", "rank64", "qv-rslora", "rank8", None, "rank64", "qv-rslora"]
    batch = prompts()
    # A budget of 16 tokens a step: every prompt is prefilled in chunks, beside others' decodes.
    with engine(base, adapters, max_num_batched_tokens=16) as llm:
        outputs = llm.generate(
            batch, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), lora_name=names
        )
    references = PeftReferences(base, adapters)
    for prompt, name, output in zip(batch, names, outputs, strict=True):
        assert output.outputs[0].token_ids == references.greedy(name, prompt, NEW_TOKENS), name
    base_tokens = [o.outputs[0].token_ids for o, n in zip(outputs, names, strict=True) if n is None]
    adapter_tokens = [o.outputs[0].token_ids for o, n in zip(outputs, names, strict=True) if n]
    # The adapters change the answers (a B of zeros would pass the parity above trivially).
    assert all(t not in base_tokens for t in adapter_tokens)


def reference_greedy_model(base: Path) -> object:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()


def test_an_adapter_gives_what_its_merged_weights_give(
    models: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    base, adapters = models
    merged = merged_dir(base, adapters["rank64"], tmp_path / "merged")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    with engine(base, adapters) as llm:
        with_adapter = llm.generate(prompts()[:4], params, lora_name="rank64")
    with LLM(str(merged), block_size=16) as llm:
        with_merged = llm.generate(prompts()[:4], params)
    assert [o.outputs[0].token_ids for o in with_adapter] == [
        o.outputs[0].token_ids for o in with_merged
    ]
    reference = reference_greedy(reference_greedy_model(merged), prompts()[0], NEW_TOKENS)
    assert with_merged[0].outputs[0].token_ids == reference.token_ids


def test_a_prefix_shared_across_adapters_is_never_served_from_another_adapters_kv(
    models: tuple[Path, dict[str, Path]],
) -> None:
    base, adapters = models
    prompt = prompts()[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with engine(base, adapters) as llm:
        order = [None, "rank8", "rank64", "rank8", None, "qv-rslora"]
        cached = [llm.generate([prompt], params, lora_name=n)[0].num_cached_tokens for n in order]
        alone = {
            n: peft_greedy(
                peft_model(base, adapters[n]) if n else reference_greedy_model(base), prompt, 4
            ).token_ids
            for n in ("rank8",)
        }
        again = llm.generate([prompt], params, lora_name="rank8")[0]
    # Each first run of a model computes the whole prompt; a second run of the same one hits.
    assert cached == [0, 0, 0, 16, 16, 0]
    assert again.outputs[0].token_ids == alone["rank8"]


def test_tensor_parallel_ranks_split_the_adapters_like_their_layers(
    models: tuple[Path, dict[str, Path]],
) -> None:
    """TP=2 on CPU (gloo): each rank holds its slice of every adapter (B's rows for q/k/v and
    gate/up, A's columns for o and down), and the batch's tokens are those of PEFT."""
    base, adapters = models
    names = [None, "rank8", "rank64", "qv-rslora"]
    batch = prompts()[:4]
    with engine(base, adapters, tensor_parallel_size=2, dtype="float32") as llm:
        outputs = llm.generate(
            batch, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), lora_name=names
        )
    references = PeftReferences(base, adapters)
    for prompt, name, output in zip(batch, names, outputs, strict=True):
        assert output.outputs[0].token_ids == references.greedy(name, prompt, NEW_TOKENS), name


def test_preempted_adapter_sequences_resume_with_their_adapter(
    models: tuple[Path, dict[str, Path]],
) -> None:
    """A pool too small for the batch: sequences are preempted and recomputed, and each comes
    back with its own adapter (possibly in another slot) and PEFT's tokens."""
    base, adapters = models
    names = ["rank8", "rank64", None, "qv-rslora", "rank8", "rank64"]
    batch = prompts()[:6]
    with engine(base, adapters, num_blocks=8, max_num_batched_tokens=64) as llm:
        outputs = llm.generate(
            batch, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), lora_name=names
        )
        preemptions = llm.engine.stats().num_preemptions
    assert preemptions > 0
    references = PeftReferences(base, adapters)
    for prompt, name, output in zip(batch, names, outputs, strict=True):
        assert output.outputs[0].token_ids == references.greedy(name, prompt, NEW_TOKENS), name


def test_more_adapters_than_slots_wait_their_turn_and_all_answer(
    models: tuple[Path, dict[str, Path]],
) -> None:
    """max_loras 1 and three adapters in one batch: a step runs one adapter (and the base
    model); the others wait for the slot, keeping their place, and every answer is PEFT's."""
    base, adapters = models
    lora = LoRAConfig(
        max_loras=1, max_lora_rank=64, modules=tuple((n, str(p)) for n, p in adapters.items())
    )
    names = ["rank8", "rank64", "qv-rslora", None]
    batch = prompts()[:4]
    with LLM(str(base), lora=lora, block_size=16) as llm:
        outputs = llm.generate(
            batch, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), lora_name=names
        )
    references = PeftReferences(base, adapters)
    for prompt, name, output in zip(batch, names, outputs, strict=True):
        assert output.outputs[0].token_ids == references.greedy(name, prompt, NEW_TOKENS), name


def test_smollm2_serves_the_base_and_three_adapters_in_one_batch_as_peft_does(
    tmp_path: Path,
) -> None:
    """The real model: SmolLM2-135M-Instruct (its GGUF dequantized), three PEFT adapters of
    ranks 8, 8 and 64 beside the base model in one batch of chat prompts, with chunked prefill."""
    from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
    from kvpilot.engine.model.loader import bundled_gguf_path

    from .reference import CHAT_QUESTIONS, chat_prompt_ids, smollm2_tokenizer

    base = gguf_to_hf_dir(bundled_gguf_path())
    specs = {
        "a8": dict(rank=8, seed=11),
        "b8": dict(rank=8, seed=12),
        "c64": dict(rank=64, seed=13),
    }
    adapters = {
        name: make_peft_adapter(base, tmp_path / name, scale=0.5, **spec)
        for name, spec in specs.items()
    }
    batch = chat_prompt_ids(smollm2_tokenizer(), CHAT_QUESTIONS[1:5])
    names = [None, "a8", "b8", "c64"]
    with engine(base, adapters, max_num_batched_tokens=64, dtype="float32") as llm:
        outputs = llm.generate(
            batch, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), lora_name=names
        )
    references = PeftReferences(base, adapters)
    for prompt, name, output in zip(batch, names, outputs, strict=True):
        assert output.outputs[0].token_ids == references.greedy(name, prompt, NEW_TOKENS), name
    answers = {n: o.outputs[0].token_ids for n, o in zip(names, outputs, strict=True)}
    assert len({tuple(answers[n]) for n in ("a8", "b8", "c64")}) == 3
