"""Async scheduling (engine/core/engine_core.py): step N+1 is scheduled and launched before step
N's sampled tokens reach the host, its inputs reading those tokens on the device. It must change
when tokens arrive, never which: the same requests give the same tokens as steps run in turn,
greedy and seeded, through chunked prefill, preemption, prefix-cache hits, stop tokens, length
limits, n > 1, logprobs, penalties and grammars (the last two wait for the step in flight)."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.structured.spec import StructuredSpec


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list]:
    outs = llm.generate(prompts, params)
    return [
        [(o.index, o.token_ids, o.finish_reason, o.stop_reason) for o in out.outputs]
        for out in outs
    ]


def workload(eos: int) -> tuple[list[list[int]], list[SamplingParams]]:
    shared = [1, *range(200, 260)]  # 61 tokens: three full blocks of 16 shared by 4 prompts
    prompts = [shared + [300 + i] * (3 + 5 * i) for i in range(4)]
    prompts += [[1, *range(400 + 11 * i, 440 + 17 * i)] for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=25),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=18, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[eos]),
        SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=9, min_p=0.1),
        SamplingParams(temperature=0.9, seed=21, max_tokens=33, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=17),
    ]
    return prompts, params


@pytest.mark.parametrize(
    "setup",
    [
        {"max_num_batched_tokens": 64},  # chunked prefills mixed with decodes
        {"max_num_batched_tokens": 512, "num_blocks": 24, "block_size": 16},  # preemption
    ],
    ids=["chunked", "preempting"],
)
def test_async_scheduling_gives_the_tokens_of_steps_in_turn(setup: dict) -> None:
    runs, engines = {}, {}
    for mode in (False, True):
        llm = LLM(dtype="float32", async_scheduling=mode, **setup)
        assert llm.engine.core.async_scheduling is mode
        prompts, params = workload(llm.engine.eos_token_ids[0])
        # The 4 shared-prefix prompts again: the second pass hits the prefix cache.
        runs[mode] = run(llm, prompts, params) + run(llm, prompts[:4], params[:4])
        assert not llm.engine.core.has_unfinished_requests()
        assert llm.engine.block_manager.usage == 0.0
        llm.engine.block_manager.check_integrity([])
        engines[mode] = llm.engine
    assert runs[True] == runs[False]
    if "num_blocks" in setup:
        assert engines[True].scheduler.num_preemptions > 0
    else:
        assert engines[True].block_manager.num_hit_tokens > 0


def test_steps_overlap_and_tokens_arrive_one_call_later() -> None:
    llm = LLM(dtype="float32", async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", [1, 2, 3, 4, 5], params)
    assert engine.step() == []  # the prefill is launched, its token not read yet
    assert engine.core.in_flight is not None
    seen = []
    while engine.has_unfinished_requests():
        seen += [len(out.outputs[0].token_ids) for out in engine.step()]
    assert seen == [1, 2, 3, 4]
    assert engine.core.in_flight is None
    seq = engine.core.scheduler  # nothing left anywhere
    assert not seq.running and not seq.waiting


def test_a_grammar_request_waits_for_the_step_in_flight() -> None:
    """A grammar's mask for step N+1 needs step N's token on the host: such steps run in turn,
    and the constrained output is the same as without async scheduling."""
    spec = StructuredSpec("regex", "(yes|no), [0-9]{3}")
    outs = {}
    for mode in (False, True):
        llm = LLM(dtype="float32", async_scheduling=mode)
        params = [
            SamplingParams(temperature=0.0, max_tokens=12, structured=spec),
            SamplingParams(temperature=0.0, max_tokens=12),
        ]
        outs[mode] = [o.outputs[0].text for o in llm.generate(["Answer:", "Count:"], params)]
    assert outs[True] == outs[False]
    first, count = outs[True][0].split(", ")
    assert first in ("yes", "no") and len(count) == 3 and count.isdigit()
