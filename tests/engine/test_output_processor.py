"""OutputProcessor on hand-made steps: inter-token gaps per request, FINAL_ONLY requests that get
no snapshot before they finish (what non-streamed server requests use), and DELTA outputs (what
streams use) that add up to the cumulative ones."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.engine.core.messages import EngineStats, SeqUpdate, StepOutputs
from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
from kvpilot.engine.model.loader import bundled_gguf_path, load_tokenizer
from kvpilot.engine.output_processor import OutputProcessor
from kvpilot.engine.outputs import OutputKind, RequestOutput, merge_deltas
from kvpilot.engine.sampling_params import SamplingParams

STATS = EngineStats(0, 0, 0.0, 1, 16, 0, 0, 0, 0, 0)


def step(token_time: float, *updates: SeqUpdate) -> StepOutputs:
    return StepOutputs(list(updates), STATS, 0, token_time=token_time)


def test_token_gaps_are_per_request_per_step_and_final_only_waits_for_the_end() -> None:
    processor = OutputProcessor(tokenizer=None)
    processor.add_request("one", None, [1, 2], SamplingParams(max_tokens=3), 0.0)
    processor.add_request(
        "two", None, [1], SamplingParams(n=2, max_tokens=3), 0.0, kind=OutputKind.FINAL_ONLY
    )

    first = processor.process(
        step(1.0, SeqUpdate("one", 0, 7), SeqUpdate("two", 0, 7), SeqUpdate("two", 1, 8))
    )
    assert first.token_gaps == []  # first tokens: time to first token, not a gap
    assert [o.request_id for o in first.outputs] == ["one"]

    # Request "two" has two sequences in the step: one gap for the request, not one per sequence.
    second = processor.process(
        step(1.5, SeqUpdate("one", 0, 9), SeqUpdate("two", 0, 9), SeqUpdate("two", 1, 9))
    )
    assert second.token_gaps == [0.5, 0.5]
    assert [o.request_id for o in second.outputs] == ["one"]

    # "one" gets no token in this step; "two" finishes one sequence and then the other.
    third = processor.process(step(2.25, SeqUpdate("two", 0, 3, finish_reason="length")))
    assert third.token_gaps == [0.75] and third.outputs == []
    fourth = processor.process(step(3.0, SeqUpdate("two", 1, 4, finish_reason="length")))
    assert fourth.token_gaps == [0.75]
    (final,) = fourth.outputs
    assert final.request_id == "two" and final.finished
    assert [o.token_ids for o in final.outputs] == [[7, 9, 3], [8, 9, 4]]

    last = processor.process(step(4.0, SeqUpdate("one", 0, 5, finish_reason="length")))
    assert last.token_gaps == [2.5]  # since "one"'s previous token, at 1.5
    assert [o.outputs[0].token_ids for o in last.outputs] == [[7, 9, 5]]


# Two sequences' texts: a multi-byte character split across tokens, and words that stop strings
# below cut (one of them across two tokens, so held-back text is sent later or never).
TEXTS = (
    "Hello wonderful world, ünïcödé 🦙 and the rest of the sentence goes on and on here.",
    "A second sequence: counting one, two, three, four, five, six, seven, eight, nine, ten.",
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(gguf_to_hf_dir(bundled_gguf_path()))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24),
        SamplingParams(n=2, max_tokens=30, stop=["the rest", "five, s"]),
        SamplingParams(n=2, max_tokens=30, stop=["sentence"], include_stop_str_in_output=True),
        SamplingParams(n=2, max_tokens=20, logprobs=2),
    ],
    ids=["plain", "stop-strings", "stop-string-kept", "logprobs"],
)
def test_delta_outputs_add_up_to_the_cumulative_outputs(
    tokenizer: Any, params: SamplingParams
) -> None:
    max_tokens = params.max_tokens or 0
    seqs = [
        tokenizer.encode(text, add_special_tokens=False)[:max_tokens] for text in TEXTS[: params.n]
    ]
    prompt = tokenizer.encode("Say something.", add_special_tokens=False)
    processors = {kind: OutputProcessor(tokenizer) for kind in OutputKind}
    for kind, processor in processors.items():
        processor.add_request("r", "Say something.", prompt, params, 0.0, kind=kind)
    merged: RequestOutput | None = None
    finals: dict[OutputKind, RequestOutput] = {}
    for position in range(max(map(len, seqs))):
        updates = []
        for index, ids in enumerate(seqs):
            if position >= len(ids):
                continue  # this sequence ended by length
            last = position == len(ids) - 1
            logprobs = (-0.5, 1, [(ids[position], -0.5), (5, -2.0)]) if params.logprobs else None
            updates.append(
                SeqUpdate("r", index, ids[position], logprobs, "length" if last else None)
            )
        results = {
            kind: p.process(step(float(position), *updates)) for kind, p in processors.items()
        }
        hits = {kind: r.stop_hits for kind, r in results.items()}
        assert hits[OutputKind.DELTA] == hits[OutputKind.CUMULATIVE]
        if not results[OutputKind.CUMULATIVE].outputs:
            break  # every sequence ended (a stop string) before its last token
        (whole,) = results[OutputKind.CUMULATIVE].outputs
        (delta,) = results[OutputKind.DELTA].outputs
        # Only what this step added: at most one token per sequence.
        assert all(len(o.token_ids) <= 1 for o in delta.outputs)
        merged = delta if merged is None else merge_deltas(merged, delta)
        assert [o.text for o in merged.outputs] == [o.text for o in whole.outputs]
        assert [o.token_ids for o in merged.outputs] == [o.token_ids for o in whole.outputs]
        assert [o.logprobs for o in merged.outputs] == [o.logprobs for o in whole.outputs]
        assert [(o.finish_reason, o.stop_reason) for o in merged.outputs] == [
            (o.finish_reason, o.stop_reason) for o in whole.outputs
        ]
        assert merged.finished == whole.finished
        for kind, result in results.items():
            if result.outputs and result.outputs[0].finished:
                finals[kind] = result.outputs[0]
                # Every kind reports the whole request's token counts when it finishes.
                assert result.generated == {"r": [len(o.token_ids) for o in whole.outputs]}
    # FINAL_ONLY's one output is the whole of it too.
    assert finals[OutputKind.FINAL_ONLY].outputs == finals[OutputKind.CUMULATIVE].outputs
    if params.stop:
        assert any(o.stop_reason in params.stop for o in finals[OutputKind.CUMULATIVE].outputs)
