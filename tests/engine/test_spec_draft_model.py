"""Draft-model speculative decoding (engine/spec_decode/draft_model.py) on a tiny random Llama
target: greedy outputs token for token those without speculation, with a smaller draft (the
target's first layer alone) through chunked prefill, prefix-cache hits and preemption; the target
as its own draft accepts every proposal; a draft of another vocabulary is refused at start; the
flag's JSON in vLLM's shapes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvpilot.contract.engine_flags import FlagError
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import SpeculativeConfig
from kvpilot.engine.model.layer_cut import cut_layers
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.server.from_flags import engine_config, parse_flags
from kvpilot.engine.spec_decode.draft_cache import DraftBlocks, DraftState
from kvpilot.engine.spec_decode.draft_model import (
    BUILTIN_NAME,
    DraftModelProposer,
    draft_bytes,
    draft_reserve,
    draft_source,
)
from kvpilot.operator.builtin_models import BUILTIN_MODELS

from .reference import save_tiny_hf_model
from .test_parity_tiny_models import llama_config

# ---- the flag --------------------------------------------------------------------------------


def spec_of(value: str, *more: str) -> SpeculativeConfig | None:
    return engine_config(parse_flags(["--speculative-config", value, *more])).speculative


def test_the_flag_takes_a_draft_model_in_vllms_shapes() -> None:
    named = spec_of('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}')
    assert named == SpeculativeConfig(method="draft_model", model="/m", num_speculative_tokens=3)
    # As vLLM's: a model without a method is a draft model, "ngram" as the model is n-gram.
    inferred = spec_of('{"model": "/m"}')
    assert inferred is not None and inferred.method == "draft_model"
    ngram = spec_of('{"model": "[ngram]"}')
    assert ngram is not None and ngram.method == "ngram"


def test_a_draft_model_is_refused_with_tensor_parallelism() -> None:
    with pytest.raises(FlagError, match="draft_model runs with tensor_parallel_size 1 only"):
        parse_flags(["--tensor-parallel-size", "2", "--speculative-config", '{"model": "/m"}'])


def test_builtin_names_the_bundled_model() -> None:
    assert BUILTIN_NAME in BUILTIN_MODELS  # the operator's spelling of the same model
    with pytest.raises(ValueError, match="the bundled model is builtin://smollm2-135m-instruct"):
        draft_source("builtin://llama-70b")


# ---- the draft's cache ------------------------------------------------------------------------


def test_the_draft_keeps_the_proposals_the_sequence_took_and_no_more() -> None:
    state = DraftState(num_computed=10, base=10, fed=[7, 8, 9])  # KV written at 10, 11, 12
    tokens = [*range(10), 7, 8, 5, 6]  # took 7 and 8, then not 9
    state.rollback(tokens)
    assert (state.num_computed, state.fed) == (12, [])
    state = DraftState(num_computed=4, base=4, fed=[1])
    state.rollback([0, 0, 0, 0, 2])  # the first proposal rejected: nothing of them kept
    assert state.num_computed == 4


def test_draft_blocks_are_reserved_whole_or_not_at_all_and_come_back() -> None:
    blocks = DraftBlocks(num_blocks=4, block_size=16)
    seqs = [
        Sequence("r", i, [1, 2, 3], num_prompt_tokens=3, params=SamplingParams()) for i in (0, 1)
    ]
    first, second = blocks.state(seqs[0]), blocks.state(seqs[1])
    assert blocks.reserve(first, 40) and len(first.blocks) == 3
    assert blocks.reserve(first, 48) and len(first.blocks) == 3  # already held
    assert not blocks.reserve(second, 20) and second.blocks == []  # 2 needed, 1 free
    assert blocks.slot(first, 17) == first.blocks[1] * 16 + 1
    blocks.keep_only({seqs[1].seq_id})  # the first sequence left the running list
    assert blocks.num_free == 4 and blocks.reserve(second, 20)


# ---- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft")
    target = save_tiny_hf_model(llama_config(4, 2), root / "target")
    other_vocab = llama_config(4, 2)
    other_vocab.vocab_size = 256
    return {
        "target": target,
        "first-layer": cut_layers(target, 1, root / "first-layer"),
        "other-vocab": save_tiny_hf_model(other_vocab, root / "other-vocab"),
    }


PROMPT_LENGTHS = (5, 16, 37, 70)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Chunked prefill (a 32-token budget cuts the long prompts, and the draft's first catch-up of
# them), and a pool that the four sequences outgrow (preemption); the prefix cache is on.
SETUP = {"dtype": "float32", "block_size": 16, "max_num_batched_tokens": 32, "num_blocks": 14}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def outputs(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.fixture(scope="module")
def plain(models: dict[str, Path]) -> list[list[int]]:
    return outputs(LLM(model=str(models["target"]), **SETUP))


def draft_engine(target: Path, draft: Path) -> LLM:
    # min_acceptance 0: every step proposes, whatever the acceptance (no back-off to hide in).
    spec = SpeculativeConfig(model=str(draft), num_speculative_tokens=3, min_acceptance=0.0)
    return LLM(model=str(target), speculative=spec, **SETUP)


def test_greedy_outputs_with_a_smaller_draft_are_those_without(
    models: dict[str, Path], plain: list[list[int]]
) -> None:
    llm = draft_engine(models["target"], models["first-layer"])
    core = llm.engine.core
    assert core.speculation is not None
    proposer = core.speculation.proposer
    assert isinstance(proposer, DraftModelProposer)
    assert len(proposer.model.model.layers) == 1
    hits_before = llm.engine.block_manager.num_hit_tokens
    # Twice: the second pass finds the prompts in the target's prefix cache (the draft, with
    # no prefix cache, still computes them).
    assert outputs(llm) == plain
    assert outputs(llm) == plain
    counters = core.speculation.counters
    # Some proposals taken, some rejected (rolled back in the draft's cache), both often.
    assert counters.num_accepted_tokens > 10
    assert counters.num_draft_tokens - counters.num_accepted_tokens > 10
    assert llm.engine.block_manager.num_hit_tokens > hits_before
    assert core.scheduler.num_preemptions > 0
    assert not core.has_unfinished_requests()
    assert llm.engine.block_manager.usage == 0.0
    # Finished sequences' draft blocks went back (at the next step's keep_only).
    core.speculation.propose(core.scheduler.running)
    assert proposer.blocks.num_free == proposer.blocks.num_blocks


def test_the_target_as_its_own_draft_accepts_every_proposal(
    models: dict[str, Path], plain: list[list[int]]
) -> None:
    llm = draft_engine(models["target"], models["target"])
    assert outputs(llm) == plain
    counters = llm.engine.core.speculation.counters
    assert counters.num_draft_tokens > 50
    assert counters.num_accepted_tokens / counters.num_draft_tokens == 1.0
    assert counters.accepted_per_pos[0] == counters.num_drafts
    # What the memory check counts for the draft is what it holds: its weights (the model's
    # parameter count, as the target's) and the pool it allocated.
    core = llm.engine.core
    proposer = core.speculation.proposer
    pool = proposer.pool.num_blocks * proposer.pool.bytes_per_block
    target_tokens = core.num_blocks * core.block_size
    counted = draft_bytes(core.config, core.model_config, target_kv_tokens=target_tokens)
    assert counted == core.model_config.num_params * 4 + pool
    # On a GPU the target's pool leaves the draft this share: as much per token, and at least
    # the pool it takes.
    reserve = draft_reserve(core.config, core.model_config, core.max_model_len)
    assert reserve.weight_bytes == core.model_config.num_params * 4
    assert reserve.kv_bytes_per_token * core.block_size == proposer.pool.bytes_per_block
    assert reserve.max_kv_tokens >= proposer.pool.num_blocks * core.block_size


def test_predictions_come_first_and_the_draft_catches_up_on_what_it_sat_out(
    models: dict[str, Path], plain: list[list[int]]
) -> None:
    """Two of four requests bring their answer as the prediction: every step of theirs proposes
    from it (all accepted), the draft proposing for the other two; greedy outputs are those
    without speculation, those of the predicted requests included (their draft state is caught
    up whenever the prediction has no match)."""
    llm = draft_engine(models["target"], models["first-layer"])
    counters = llm.engine.core.speculation.counters
    baseline = outputs(llm)
    accepted_without = counters.num_accepted_tokens  # the engine is new: all of the first pass
    params = [
        dataclasses.replace(GREEDY, prediction_token_ids=tuple(plain[i])) if i < 2 else GREEDY
        for i in range(len(PROMPT_LENGTHS))
    ]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(), params)]
    assert baseline == plain and got == plain
    accepted_with = counters.num_accepted_tokens - accepted_without
    # Two 24-token answers proposed from their predictions: most of their tokens come accepted.
    assert accepted_with >= accepted_without + 20, (accepted_with, accepted_without)
    # A prediction that is wrong from its first token on: the draft proposes instead.
    wrong = [dataclasses.replace(GREEDY, prediction_token_ids=(1, 1, 1, 1)) for _ in prompts()]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), wrong)] == plain


def test_a_draft_of_another_vocabulary_is_refused_at_start(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError) as caught:
        draft_engine(models["target"], models["other-vocab"])
    assert "has a vocabulary of 256 tokens, the target's has 512" in str(caught.value)
    assert "must share the target's tokenizer" in str(caught.value)
