"""Grammar-constrained decoding in the engine: the bitmask against a per-token reference, the
backend's checks and cache, matchers ending only at an allowed end, and the real SmolLM2 under
constraints (n > 1 each with its own matcher, a tiny KV pool that forces preemption, masks filled
during the forward pass or after it giving the same tokens)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import STRUCTURED_OUTPUTS_BACKENDS, EngineConfig
from kvpilot.engine.model.loader import eos_token_ids, load_tokenizer, resolve_model
from kvpilot.engine.structured.backend import (
    BACKEND_NAMES,
    GrammarBackend,
    GrammarError,
    resolve_backend,
)
from kvpilot.engine.structured.bitmask import (
    GrammarMask,
    apply_bitmask,
    apply_bitmask_reference,
    bitmask_to_bias,
    unpack_bitmask,
)
from kvpilot.engine.structured.manager import StructuredOutputs
from kvpilot.engine.structured.registry import create_backend, to_grammar
from kvpilot.engine.structured.spec import StructuredSpec
from kvpilot.engine.structured.xgrammar_backend import XGrammarBackend

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
    logits = torch.randn(3, vocab, generator=gen)
    for rows in ([0, 1, 2], [0, 2]):
        masked, reference = logits.clone(), logits.clone()
        apply_bitmask(masked, bitmask, rows)
        apply_bitmask_reference(reference, bitmask, rows)
        for r in range(3):
            expected = logits[r].masked_fill(~allowed[r], float("-inf")) if r in rows else logits[r]
            assert torch.equal(masked[r], expected)  # rows without a grammar untouched
        assert torch.equal(masked, reference)
        # The additive bias the mask thread builds masks exactly the same.
        for mask in (
            GrammarMask(tuple(rows), bitmask=bitmask),
            GrammarMask(tuple(rows), bias=bitmask_to_bias(bitmask, vocab)),
        ):
            out = logits.clone()
            mask.apply(out)
            assert torch.equal(out, reference)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize(
    "spec",
    [
        StructuredSpec("json", '{"type": "nonsense"}'),
        StructuredSpec("json", '{"type": "integer", "minimum": "zero"}'),
        StructuredSpec("json", "[1, 2]"),
        StructuredSpec("regex", "(unclosed"),
        StructuredSpec("grammar", "root ::= ("),
        StructuredSpec("choice", "[]"),
    ],
)
def test_bad_specs_raise_grammar_error(spec: StructuredSpec, backend: str) -> None:
    with pytest.raises(GrammarError):
        to_grammar(spec, backend)


def test_backend_names_agree_with_the_config() -> None:
    assert ("auto", *BACKEND_NAMES) == STRUCTURED_OUTPUTS_BACKENDS
    with pytest.raises(GrammarError):
        resolve_backend("outlines")
    with pytest.raises(ValueError, match="structured_outputs_backend"):
        EngineConfig(structured_outputs_backend="outlines")


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        StructuredSpec("yaml")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model(None, "auto").hf_dir)


@pytest.fixture(scope="module", params=BACKEND_NAMES)
def backend(request: pytest.FixtureRequest, tokenizer: Any) -> GrammarBackend:
    return create_backend(request.param, tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def test_compiled_grammars_are_cached_by_spec(tokenizer: Any) -> None:
    backend = XGrammarBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), cache_size=2)
    a, b, c = (StructuredSpec.choice([w]) for w in ("alpha", "beta", "gamma"))
    first = backend.compile_spec(a)
    before = backend.num_compiles
    assert backend.compile_spec(a) is first and backend.num_compiles == before
    backend.compile_spec(b)
    backend.compile_spec(c)  # evicts a (least recently used; the cache holds 2)
    assert backend.num_compiles == before + 2
    assert backend.compile_spec(a) is not first and backend.num_compiles == before + 3


def test_eos_is_allowed_only_where_the_grammar_may_end(
    backend: GrammarBackend, tokenizer: Any
) -> None:
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
        n=3, temperature=1.0, seed=9, max_tokens=64, structured=StructuredSpec.json_schema(SCHEMA)
    )
    (out,) = llm.chat([[{"role": "user", "content": "Rate a movie as JSON."}]], params)
    texts = [o.text for o in out.outputs]
    for o in out.outputs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len(set(texts)) > 1  # sampled apart, yet each one valid


def test_preempted_constrained_sequences_stay_valid(llm: LLM) -> None:
    prompts = [[{"role": "user", "content": f"Code number {i}, please."}] for i in range(6)]
    pattern = r"[A-Z]{3}-\d{30}"
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
        temperature=0.0, max_tokens=24, structured=StructuredSpec.json_schema(SCHEMA)
    )
    overlapped = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    llm.engine.core.structured.overlap = False
    try:
        serial = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    finally:
        llm.engine.core.structured.overlap = True
    assert overlapped == serial


def test_llguidance_backend_in_the_engine(llm: LLM) -> None:
    # The same core with its structured outputs on llguidance (what
    # structured_outputs_backend="llguidance" builds), without loading the model twice.
    core = llm.engine.core
    xgrammar_outputs = core.structured
    core.structured = StructuredOutputs(
        resolve_model(None, "auto").hf_dir,
        core.model_config.vocab_size,
        tuple(core.model_config.eos_token_ids),
        backend_name="llguidance",
    )
    try:
        params = SamplingParams(
            n=2,
            temperature=1.0,
            seed=4,
            max_tokens=64,
            structured=StructuredSpec.json_schema(SCHEMA),
        )
        (out,) = llm.chat([[{"role": "user", "content": "Rate a movie as JSON."}]], params)
        assert core.structured.backend.name == "llguidance"
    finally:
        core.structured = xgrammar_outputs
    for o in out.outputs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_the_core_reports_its_backend() -> None:
    assert EngineConfig(structured_outputs_backend="auto").structured_outputs_backend == "auto"
    assert resolve_backend("auto") == "xgrammar"


def test_the_backends_load_and_a_compile_never_hold_up_free_requests(llm: LLM) -> None:
    """The first constrained request loads the backend (the vocabulary: seconds) on the compile
    thread: while it loads, grammars_for returns at once, the request waits, and a free request
    decodes to its end; then the constrained one runs, valid."""
    core = llm.engine.core
    release = threading.Event()
    started = threading.Event()
    hf_dir = resolve_model(None, "auto").hf_dir
    kept = core.structured

    def slow_load() -> GrammarBackend:
        started.set()
        assert release.wait(60), "the test never released the backend's load"
        tokenizer = load_tokenizer(hf_dir)
        stops = eos_token_ids(tuple(core.model_config.eos_token_ids), tokenizer)
        return create_backend("xgrammar", tokenizer, core.model_config.vocab_size, stops)

    core.structured = StructuredOutputs(
        hf_dir,
        core.model_config.vocab_size,
        tuple(core.model_config.eos_token_ids),
        backend_factory=slow_load,
    )
    try:
        constrained = SamplingParams(
            temperature=0.0, max_tokens=48, structured=StructuredSpec.json_schema(SCHEMA)
        )
        free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        llm.engine.add_request("constrained", "A movie rating as JSON.", constrained)
        assert started.wait(30)
        llm.engine.add_request("free", "Once upon a time", free)
        done: dict[str, Any] = {}
        while "free" not in done:
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert "constrained" not in done and len(done["free"].outputs[0].token_ids) == 8
        assert [s.request_id for s in core.scheduler.waiting] == ["constrained"]
        release.set()
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        release.set()
        core.structured.shutdown()
        core.structured = kept
    text = done["constrained"].outputs[0].text
    assert done["constrained"].outputs[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_backend_that_failed_to_load_refuses_later_requests_with_its_reason() -> None:
    release = threading.Event()

    def broken() -> GrammarBackend:
        release.wait(30)
        raise OSError("tokenizer.json: no such file")

    hf_dir = resolve_model(None, "auto").hf_dir
    outputs = StructuredOutputs(hf_dir, 49152, (2,), backend_factory=broken)
    try:
        spec = StructuredSpec.json_schema(SCHEMA)
        (first,) = outputs.grammars_for(spec, 1)  # the load runs (and fails) on the compile thread
        release.set()
        with pytest.raises(OSError, match="no such file"):
            first.compiled.result(timeout=30)
        with pytest.raises(ValueError, match=r"unavailable: tokenizer\.json: no such file"):
            outputs.grammars_for(spec, 1)
    finally:
        release.set()
        outputs.shutdown()
