"""Sampling, stop handling, n, abort and the offline API on the real model (one engine per
module and scheduling mode: every test runs with steps in turn, and with async scheduling, where
step N+1 is launched before step N's tokens are read)."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.detokenizer import find_stop_string
from kvpilot.engine.outputs import OutputKind


@pytest.fixture(scope="module", params=[False, True], ids=["steps-in-turn", "async"])
def llm(request: pytest.FixtureRequest) -> LLM:
    return LLM(dtype="float32", max_num_batched_tokens=512, async_scheduling=request.param)


def chat(llm: LLM, question: str) -> str:
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


QUESTIONS = [f"Tell me a short fact about the number {i}." for i in range(16)]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch_of_16(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate([chat(llm, QUESTIONS[3])], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=24) for i in range(16)]
    others[7] = seeded
    batch = llm.generate(
        [chat(llm, q) for q in [*QUESTIONS[:7], QUESTIONS[3], *QUESTIONS[8:]]], others
    )
    assert batch[7].outputs[0].token_ids == alone
    # and sampling really samples: different seeds give different continuations somewhere
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) > 8


def test_n_completions_are_independent_and_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16)
    first = llm.generate([chat(llm, "Name a color.")], params)[0]
    again = llm.generate([chat(llm, "Name a color.")], params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_stop_string_spanning_tokens_is_cut_and_not_returned(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    full = llm.generate([chat(llm, "What is the capital of France?")], greedy)[0].outputs[0].text
    assert "Paris" in full
    stop = "of Fr"  # spans token boundaries in "of France"
    assert stop in full
    out = llm.generate(
        [chat(llm, "What is the capital of France?")],
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]),
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_stop_token_and_eos_and_length(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    base = llm.generate([chat(llm, "What is the capital of France?")], greedy)[0].outputs[0]
    assert base.finish_reason == "stop" and base.token_ids[-1] in llm.engine.eos_token_ids
    cut = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[base.token_ids[2]])
    out = llm.generate([chat(llm, "What is the capital of France?")], cut)[0].outputs[0]
    assert out.token_ids == base.token_ids[:3] and out.stop_reason == base.token_ids[2]
    short = SamplingParams(temperature=0.0, max_tokens=3)
    out = llm.generate([chat(llm, "What is the capital of France?")], short)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == base.token_ids[:3]
    forever = SamplingParams(temperature=0.0, max_tokens=len(base.token_ids) + 5, ignore_eos=True)
    out = llm.generate([chat(llm, "What is the capital of France?")], forever)[0].outputs[0]
    assert len(out.token_ids) == len(base.token_ids) + 5 and out.finish_reason == "length"


def test_multibyte_characters_are_never_split(llm: LLM) -> None:
    prompt = chat(llm, "Repeat exactly: 日本語のテキスト 🙂 café")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
    assert "\ufffd" not in out.text
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_penalties_change_the_distribution(llm: LLM) -> None:
    prompt = chat(llm, "Say 'la' twenty times.")
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30))[0]
    penalized = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=30, frequency_penalty=2.0)
    )[0]
    ids = penalized.outputs[0].token_ids
    assert ids != plain.outputs[0].token_ids
    assert max(ids.count(t) for t in set(ids)) < max(
        plain.outputs[0].token_ids.count(t) for t in set(plain.outputs[0].token_ids)
    )


def test_logprobs_report_top_n_and_rank(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    out = llm.generate([chat(llm, "Hello")], params)[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_abort_mid_generation_frees_all_blocks(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("to-abort", chat(llm, "Write a long story."), SamplingParams(max_tokens=200))
    engine.add_request("other", chat(llm, "Hi"), SamplingParams(max_tokens=200))
    for _ in range(5):
        engine.step()
    assert engine.stats().kv_cache_usage > 0
    engine.abort_request("to-abort")
    engine.abort_request("other")
    engine.abort_request("never-existed")  # ignored
    assert engine.stats().kv_cache_usage == 0.0
    assert not engine.has_unfinished_requests() and engine.step() == []
    engine.block_manager.check_integrity([])


def test_reset_prefix_cache_forgets_cached_prompts(llm: LLM) -> None:
    prompt = [[7] * 40 + [9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(prompt, params)
    assert llm.generate(prompt, params)[0].num_cached_tokens == 32  # two full blocks of 16
    assert llm.reset_prefix_cache()
    assert llm.generate(prompt, params)[0].num_cached_tokens == 0
    llm.engine.add_request("in-flight", prompt[0], params)
    assert not llm.reset_prefix_cache()  # refused while a request runs
    llm.engine.abort_request("in-flight")
    assert llm.reset_prefix_cache()


def test_prompts_too_long_are_rejected_with_numbers(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match=r"prompt has 9000 tokens.*context is 8192"):
        engine.add_request("long", [1] * 9000, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 49152\)"):
        engine.add_request("bad", [1, 99999], SamplingParams())
    assert not engine.has_unfinished_requests()


def test_prompt_larger_than_the_pool_is_rejected() -> None:
    small = LLM(dtype="float32", num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match=r"whole KV cache holds 64 tokens \(4 blocks of 16\)"):
        small.engine.add_request("big", list(range(100)), SamplingParams())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("logprobs", 21),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_find_stop_string_only_looks_at_new_text() -> None:
    assert find_stop_string("abc STOP def", 3, ("STOP",)) is None  # already seen before
    assert find_stop_string("abc ST", 2, ("STOP",)) is None
    assert find_stop_string("abc STOP", 2, ("STOP",)) == (4, "STOP")
    assert find_stop_string("x END y STOP", 9, ("STOP", "END")) == (2, "END")


def test_final_only_requests_report_once_when_finished(llm: LLM) -> None:
    """A FINAL_ONLY request (what LLM.generate adds) yields no snapshot while it runs and one
    finished output, the same one a per-step request ends with."""
    engine = llm.engine
    prompt = chat(llm, "Name a color.")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("every-step", prompt, params)
    engine.add_request("final", prompt, params, kind=OutputKind.FINAL_ONLY)
    seen: dict[str, list] = {"every-step": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["every-step"]) == 6
    assert [o.finished for o in seen["final"]] == [True]
    final, last = seen["final"][0].outputs[0], seen["every-step"][-1].outputs[0]
    assert final.token_ids == last.token_ids and final.text == last.text
    assert final.finish_reason == last.finish_reason == "length"
