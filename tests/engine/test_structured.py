"""Grammar-constrained decoding in the engine: the bitmask against a per-token reference, the
backend's checks and cache, matchers ending only at an allowed end, and the real SmolLM2 under
constraints (n > 1 each with its own matcher, a tiny KV pool that forces preemption, masks filled
during the forward pass or after it giving the same tokens)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.loader import load_tokenizer, resolve_model
from kvpilot.engine.structured.backend import GrammarError, XGrammarBackend, to_grammar
from kvpilot.engine.structured.bitmask import apply_bitmask, unpack_bitmask
from kvpilot.engine.structured.spec import StructuredSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "score", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("vocab", [64, 100, 49152])
def test_bitmask_matches_a_per_token_reference(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, vocab)
    for r in range(3):
        for t in range(0, vocab, max(1, vocab // 257)):
            bit = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert bool(allowed[r, t]) == bool(bit)
    logits = torch.randn(5, vocab, generator=gen)
    masked = logits.clone()
    apply_bitmask(masked, bitmask, [0, 2, 4])
    for out_row, mask_row in ((0, 0), (2, 1), (4, 2)):
        expected = logits[out_row].masked_fill(~allowed[mask_row], float("-inf"))
        assert torch.equal(masked[out_row], expected)
    assert torch.equal(masked[[1, 3]], logits[[1, 3]])  # rows without a grammar untouched


@pytest.mark.parametrize(
    "spec",
    [
        StructuredSpec("json", '{"type": "nonsense"}'),
        StructuredSpec("json", '{"type": "integer", "minimum": "zero"}'),
        StructuredSpec("json", "[1, 2]"),
        StructuredSpec("regex", "(unclosed"),
        StructuredSpec("grammar", "root ::= "),
        StructuredSpec("choice", "[]"),
    ],
)
def test_bad_specs_raise_grammar_error(spec: StructuredSpec) -> None:
    with pytest.raises(GrammarError):
        to_grammar(spec)


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        StructuredSpec("yaml")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def backend() -> XGrammarBackend:
    tokenizer = load_tokenizer(resolve_model(None, "auto").hf_dir)
    return XGrammarBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), cache_size=2)


def test_compiled_grammars_are_cached_by_spec(backend: XGrammarBackend) -> None:
    a, b, c = (StructuredSpec.choice([w]) for w in ("alpha", "beta", "gamma"))
    first = backend.compile_spec(a)
    before = backend.num_compiles
    assert backend.compile_spec(a) is first and backend.num_compiles == before
    backend.compile_spec(b)
    backend.compile_spec(c)  # evicts a (least recently used; the cache holds 2)
    assert backend.num_compiles == before + 2
    assert backend.compile_spec(a) is not first and backend.num_compiles == before + 3


def test_eos_is_allowed_only_where_the_grammar_may_end(backend: XGrammarBackend) -> None:
    tokenizer = load_tokenizer(resolve_model(None, "auto").hf_dir)
    eos = tokenizer.eos_token_id
    matcher = backend.matcher(backend.compile_spec(StructuredSpec("regex", r"ab+")))
    bitmask = backend.allocate_bitmask(1)

    def allowed() -> torch.Tensor:
        matcher.fill_mask(bitmask, 0)
        return unpack_bitmask(bitmask, backend.vocab_size)[0]

    assert not allowed()[eos]
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert allowed()[token]
        assert matcher.accept(token)
    assert allowed()[eos] and not matcher.is_terminated
    assert matcher.accept(eos) and matcher.is_terminated


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # 24 blocks of 16 tokens: a few constrained sequences fill it, so some get preempted and
    # recomputed while their matchers keep their place.
    yield LLM(num_blocks=24, max_num_seqs=8)


def test_n_sequences_each_follow_their_own_matcher(llm: LLM) -> None:
    params = SamplingParams(
        n=4, temperature=1.0, seed=9, max_tokens=64, structured=StructuredSpec.json_schema(SCHEMA)
    )
    (out,) = llm.chat([[{"role": "user", "content": "Rate a movie as JSON."}]], params)
    texts = [o.text for o in out.outputs]
    for o in out.outputs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len(set(texts)) > 1  # sampled apart, yet each one valid
    (again,) = llm.chat([[{"role": "user", "content": "Rate a movie as JSON."}]], params)
    assert [o.text for o in again.outputs] == texts  # seeded


def test_preempted_constrained_sequences_stay_valid(llm: LLM) -> None:
    prompts = [[{"role": "user", "content": f"Code number {i}, please."}] for i in range(6)]
    pattern = r"[A-Z]{3}-\d{40}"
    params = SamplingParams(
        temperature=0.0, max_tokens=64, structured=StructuredSpec("regex", pattern)
    )
    before = llm.engine.scheduler.num_preemptions
    outs = llm.chat(prompts, params)
    assert llm.engine.scheduler.num_preemptions > before  # the pool was too small for all six
    for out in outs:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


def test_masks_during_or_after_the_forward_give_the_same_tokens(llm: LLM) -> None:
    prompts = [[{"role": "user", "content": "A movie rating as JSON."}]] * 2
    params = SamplingParams(
        temperature=0.0, max_tokens=48, structured=StructuredSpec.json_schema(SCHEMA)
    )
    overlapped = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    llm.engine.core.structured.overlap = False
    try:
        serial = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    finally:
        llm.engine.core.structured.overlap = True
    assert overlapped == serial
