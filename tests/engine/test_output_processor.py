"""OutputProcessor on hand-made steps: inter-token gaps per request, and final_only requests that
get no snapshot before they finish (what non-streamed server requests use)."""

from __future__ import annotations

from kvpilot.engine.core.messages import EngineStats, SeqUpdate, StepOutputs
from kvpilot.engine.output_processor import OutputProcessor
from kvpilot.engine.sampling_params import SamplingParams

STATS = EngineStats(0, 0, 0.0, 1, 16, 0, 0, 0, 0, 0)


def step(token_time: float, *updates: SeqUpdate) -> StepOutputs:
    return StepOutputs(list(updates), STATS, 0, token_time=token_time)


def test_token_gaps_are_per_request_per_step_and_final_only_waits_for_the_end() -> None:
    processor = OutputProcessor(tokenizer=None)
    processor.add_request("one", None, [1, 2], SamplingParams(max_tokens=3), 0.0)
    processor.add_request("two", None, [1], SamplingParams(n=2, max_tokens=3), 0.0, final_only=True)

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
