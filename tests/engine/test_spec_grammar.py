"""Speculation with a grammar, penalties and logprobs: proposals cut where the grammar refuses
them, each verified row masked by the grammar's state after the proposals before it, the matcher
moved by the emitted tokens only; sampled rows never draw a masked token and follow the masked
distribution; greedy outputs (JSON schema, regex; both backends) token for token those without
speculation on a tiny random Llama with SmolLM2's tokenizer; per-request acceptance adding up to
the engine's counters."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import SpeculativeConfig
from kvpilot.engine.model.loader import load_tokenizer, resolve_model
from kvpilot.engine.sampler import SamplerRow
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.spec_decode.grammar import cut_to_grammar
from kvpilot.engine.spec_decode.verify import VerifyRow, verify
from kvpilot.engine.structured.backend import BACKEND_NAMES, GrammarBackend
from kvpilot.engine.structured.bitmask import GrammarMask, unpack_bitmask
from kvpilot.engine.structured.manager import SequenceGrammar, StructuredOutputs
from kvpilot.engine.structured.registry import create_backend, to_grammar
from kvpilot.engine.structured.spec import StructuredSpec

from .reference import save_tiny_hf_model
from .test_spec_decode import CHI2_CRITICAL_0_001, chi_square
from .test_structured import SCHEMA

VOCAB = 49152  # SmolLM2's tokenizer
EOS = 2
REGEX = r"(ab|cd|ef){3,40}x"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model(None, "auto").hf_dir)


@pytest.fixture(scope="module")
def backends(tokenizer: Any) -> dict[str, GrammarBackend]:
    return {name: create_backend(name, tokenizer, VOCAB, (EOS,)) for name in BACKEND_NAMES}


def sequence_grammar(backend: GrammarBackend, spec: StructuredSpec) -> SequenceGrammar:
    loaded: Future[GrammarBackend] = Future()
    loaded.set_result(backend)
    compiled: Future[Any] = Future()
    compiled.set_result(backend.compile_spec(spec, to_grammar(spec, backend.name)))
    return SequenceGrammar(loaded, compiled)


def mask_of(grammar: SequenceGrammar, backend: GrammarBackend) -> torch.Tensor:
    bitmask = backend.allocate_bitmask(1)
    grammar.matcher.fill_mask(bitmask, 0)
    return bitmask.clone()


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_a_proposal_the_grammar_refuses_is_cut_and_the_rows_are_masked_after_each_proposal(
    name: str, backends: dict[str, GrammarBackend], tokenizer: Any
) -> None:
    backend = backends[name]
    grammar = sequence_grammar(backend, StructuredSpec("regex", REGEX))
    ab, cd, x = (tokenizer.convert_tokens_to_ids(t) for t in ("ab", "cd", "x"))
    zz = tokenizer.convert_tokens_to_ids("zz")
    start = mask_of(grammar, backend)
    seq = Sequence("r", 0, [1, 2, 3], num_prompt_tokens=3, params=SamplingParams(), grammar=grammar)
    # "abab" then "zz", which the regex refuses: cut before it, and the matcher has not moved.
    seq.spec_token_ids = [ab, ab, zz, cd]
    cut_to_grammar([seq])
    assert seq.spec_token_ids == [ab, ab]
    assert torch.equal(mask_of(grammar, backend), start)
    # A proposal after which the grammar ends ("x" closes the regex for llguidance; xgrammar
    # ends only at the stop token) leaves nothing after it to verify: cut before that too.
    seq.spec_token_ids = [ab, cd, ab, x, EOS]
    cut_to_grammar([seq])
    assert seq.spec_token_ids in ([ab, cd, ab], [ab, cd, ab, x])

    # The k + 1 rows of [ab, ab]: each masked by the state after the proposals before it. The
    # raw logits favour "zz" (never allowed), then "x" (allowed only after three pairs: at no
    # row), so the masked argmax takes "ab", "ab" (both proposals accepted), then "cd".
    bitmask = backend.allocate_bitmask(3)
    grammar.fill_rows(bitmask, 0, [ab, ab])
    assert torch.equal(mask_of(grammar, backend), start)  # rolled back past the proposals
    allowed = unpack_bitmask(bitmask, VOCAB)
    assert not allowed[:, zz].any()
    assert allowed[:, ab].all() and allowed[:, cd].all()
    assert not allowed[0, x] and not allowed[1, x] and not allowed[2, x]
    logits = torch.zeros(3, VOCAB)
    logits[:, zz] = 10.0
    logits[:, x] = 9.0
    logits[:, ab] = torch.tensor([8.0, 8.0, 1.0])
    logits[:, cd] = torch.tensor([1.0, 1.0, 8.0])
    GrammarMask((0, 1, 2), bitmask=bitmask).apply(logits)
    row = VerifyRow(SamplerRow(SamplingParams(temperature=0.0), [], None), [ab, ab])
    verified = verify(logits, [row], torch.Generator(), lambda t: t.argmax(-1))
    assert verified.token_ids == [[ab, ab, cd]]
    # The matcher then moves by exactly the emitted tokens, and "x" is allowed after them.
    for token in verified.token_ids[0]:
        grammar.accept(token)
    assert not grammar.is_broken
    after = unpack_bitmask(mask_of(grammar, backend), VOCAB)
    assert after[0, x] and not after[0, zz]


def test_sampled_verification_never_draws_a_masked_token() -> None:
    """Rejection sampling over masked rows: the masked draft is always rejected, the emitted
    token follows the masked, renormalized target distribution, and a masked token never comes
    out."""
    vocab = 6
    probs = torch.tensor(
        [
            [0.05, 0.40, 0.10, 0.25, 0.15, 0.05],
            [0.30, 0.05, 0.20, 0.10, 0.05, 0.30],
        ]
    )
    logits = probs.log()
    # Row 0 forbids tokens 1 (the likeliest) and 3 (the draft); row 1 forbids token 5.
    allowed = torch.tensor([[1, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    bits = (allowed.to(torch.int64) << torch.arange(vocab)).sum(-1).to(torch.int32)
    mask = GrammarMask((0, 1), bitmask=bits.unsqueeze(1))
    masked_probs = (probs * allowed).div((probs * allowed).sum(-1, keepdim=True))
    generator = torch.Generator().manual_seed(99)
    row = VerifyRow(SamplerRow(SamplingParams(temperature=1.0), [], generator), [3])
    counts = [0] * vocab
    num_draws = 4000
    for _ in range(num_draws):
        masked = logits.clone()
        mask.apply(masked)
        (tokens,) = verify(masked, [row], torch.Generator(), lambda t: t.argmax(-1)).token_ids
        assert len(tokens) == 1  # the draft (masked) is never accepted
        counts[tokens[0]] += 1
    assert counts[1] == counts[3] == 0
    assert chi_square(counts, masked_probs[0].tolist()) < CHI2_CRITICAL_0_001[5]
    # The test can fail: draws from the unmasked row would be far off.
    unmasked = [round(p * num_draws) for p in probs[0].tolist()]
    assert chi_square(unmasked, masked_probs[0].tolist()) > 50 * CHI2_CRITICAL_0_001[5]


# ---- the engine on a tiny random Llama with SmolLM2's tokenizer ---------------------------------

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1)
PROMPTS = [f"item {i}: ab ab ab cd cd ef" for i in range(4)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Iterator[LLM]:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=512,
        initializer_range=0.15,  # peaky logits: greedy has no near-ties to flip
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=EOS,
    )
    path: Path = save_tiny_hf_model(config, tmp_path_factory.mktemp("tiny") / "llama")
    tokenizer.save_pretrained(str(path))
    with LLM(model=str(path), dtype="float32", speculative=SPEC, block_size=16) as engine:
        yield engine


@pytest.fixture(params=BACKEND_NAMES)
def backend_name(request: pytest.FixtureRequest, llm: LLM) -> Iterator[str]:
    """The engine's structured outputs on each backend in turn (one model load)."""
    core = llm.engine.core
    own = core.structured
    if request.param != own.backend_name:
        core.structured = StructuredOutputs(
            Path(core.description.hf_dir),
            core.model_config.vocab_size,
            tuple(core.model_config.eos_token_ids),
            backend_name=request.param,
        )
    try:
        yield request.param
    finally:
        core.structured = own


def with_and_without_speculation(
    llm: LLM, params: SamplingParams, prompts: list[str] = PROMPTS
) -> tuple[list[Any], list[Any], tuple[int, int]]:
    """The outputs without speculation, with it, and the counters' (drafts, accepted) growth."""
    core = llm.engine.core
    policy = core.speculation
    assert policy is not None
    core.speculation = None
    try:
        plain = llm.generate(prompts, params)
    finally:
        core.speculation = policy
    drafts, accepted = policy.counters.num_draft_tokens, policy.counters.num_accepted_tokens
    # Each comparison starts from the acceptance a new engine assumes: an earlier test's low
    # acceptance would otherwise leave only the back-off's probe steps proposing.
    policy.acceptance = 1.0
    spec = llm.generate(prompts, params)
    growth = (
        policy.counters.num_draft_tokens - drafts,
        policy.counters.num_accepted_tokens - accepted,
    )
    return plain, spec, growth


@pytest.mark.parametrize(
    "structured", [StructuredSpec.json_schema(SCHEMA), StructuredSpec("regex", REGEX)]
)
def test_greedy_structured_outputs_are_those_without_speculation_and_valid(
    llm: LLM, backend_name: str, structured: StructuredSpec
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60, structured=structured)
    plain, spec, (drafts, accepted) = with_and_without_speculation(llm, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert drafts > 0
    if structured.kind == "regex":  # the random model repeats pairs: proposals hit
        assert accepted > 0
    for out in spec:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        if structured.kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            jsonschema.validate(json.loads(text), SCHEMA)
    # Per request: what it proposed and accepted, adding up to the engine's counters.
    assert sum(o.num_draft_tokens for o in spec) == drafts
    assert sum(o.num_accepted_tokens for o in spec) == accepted
    assert all(o.num_draft_tokens == 0 for o in plain)


def test_penalties_and_logprobs_with_speculation_are_those_without(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=40, presence_penalty=0.5, frequency_penalty=0.3, logprobs=2
    )
    prompts = ["ab ab ab ab ab ab ab ab cd cd cd cd cd cd ab ab ab ab", *PROMPTS[:2]]
    plain, spec, (drafts, _) = with_and_without_speculation(llm, params, prompts)
    # (The penalties keep this random model from repeating: its proposals are rarely accepted.)
    assert drafts > 0
    for a, b in zip(plain, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].logprobs is not None and a.outputs[0].logprobs is not None
        assert len(b.outputs[0].logprobs) == len(b.outputs[0].token_ids)
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert pa.keys() == pb.keys()
            for token, lp in pa.items():
                assert pb[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
                assert pb[token].rank == lp.rank
