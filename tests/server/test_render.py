"""Response builders: logprobs in both OpenAI formats, stream deltas, SSE framing. No server."""

from __future__ import annotations

import json

from kvpilot.engine.outputs import CompletionOutput, Logprob
from kvpilot.engine.server import render

# Two generated tokens (ids 7 and 9); rank 1 is the best. Token 9 was sampled at rank 2.
STEPS = [
    {7: Logprob(-0.1, 1, "Hi"), 8: Logprob(-2.5, 2, "Hey"), 3: Logprob(-4.0, 3, "Yo")},
    {9: Logprob(-1.2, 2, " you"), 4: Logprob(-0.4, 1, " there"), 5: Logprob(float("-inf"), 3, "!")},
]


def test_completion_logprobs_hold_top_n_plus_the_sampled_token() -> None:
    body, end = render.completion_logprobs([7, 9], STEPS, num_top=1, text_offset=5)
    assert body["tokens"] == ["Hi", " you"]
    assert body["token_logprobs"] == [-0.1, -1.2]
    # Top-1 of step 2 is " there"; the sampled " you" is added beside it (OpenAI: up to N+1).
    assert body["top_logprobs"] == [{"Hi": -0.1}, {" there": -0.4, " you": -1.2}]
    assert body["text_offset"] == [5, 7]
    assert end == 11


def test_completion_logprobs_zero_gives_only_the_sampled_token() -> None:
    body, _ = render.completion_logprobs([7, 9], STEPS, num_top=0, text_offset=0)
    assert body["top_logprobs"] == [{"Hi": -0.1}, {" you": -1.2}]


def test_chat_logprobs_list_exactly_top_n_in_rank_order_with_bytes() -> None:
    body = render.chat_logprobs([7, 9], STEPS, num_top=3)
    first, second = body["content"]
    assert first["token"] == "Hi" and first["logprob"] == -0.1 and first["bytes"] == [72, 105]
    assert [t["token"] for t in first["top_logprobs"]] == ["Hi", "Hey", "Yo"]
    assert [t["token"] for t in second["top_logprobs"]] == [" there", " you", "!"]
    # -inf is not JSON: it is clamped as OpenAI and vLLM do.
    assert second["top_logprobs"][2]["logprob"] == render.MIN_LOGPROB
    assert render.chat_logprobs([7], STEPS[:1], num_top=0)["content"][0]["top_logprobs"] == []


def test_next_delta_counts_delta_outputs_and_finishes_once() -> None:
    cursor = render.ChoiceCursor()
    delta = render.next_delta(cursor, CompletionOutput(index=0, text="Hel", token_ids=[1, 2]))
    assert delta is not None and delta.text == "Hel" and delta.token_ids == [1, 2]
    assert render.next_delta(cursor, CompletionOutput(index=0, text="", token_ids=[])) is None
    # A token arrived but its text is held back (possible stop string): tokens still count.
    delta = render.next_delta(cursor, CompletionOutput(index=0, text="", token_ids=[3]))
    assert delta is not None and delta.text == "" and delta.token_ids == [3]
    done = CompletionOutput(
        index=0, text="lo", token_ids=[4], finish_reason="stop", stop_reason="!"
    )
    delta = render.next_delta(cursor, done)
    assert delta is not None and delta.text == "lo" and delta.finish_reason == "stop"
    assert delta.stop_reason == "!" and cursor.num_tokens == 4
    # A finished choice repeats in its request's later outputs (n > 1): sent once.
    repeat = CompletionOutput(index=0, text="", token_ids=[], finish_reason="stop")
    assert render.next_delta(cursor, repeat) is None and cursor.num_tokens == 4


def test_usage_has_cached_tokens_and_prediction_details() -> None:
    assert render.usage(10, 4, 8, draft_tokens=6, accepted_tokens=2) == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8},
        "completion_tokens_details": {
            "accepted_prediction_tokens": 2,
            "rejected_prediction_tokens": 4,
        },
    }


def test_sse_frames_one_data_line_and_keeps_unicode() -> None:
    payload = {"text": "héllo\nworld", "n": [1, -2.5, None, True], "nested": {"k": '\u2028\t"\\'}}
    event = render.sse(payload)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2  # the newline inside the text is escaped by JSON
    assert "héllo".encode() in event  # UTF-8, not \u escapes (ensure_ascii=False)
    assert json.loads(event[len(b"data: ") :]) == payload
    # Byte for byte what json.dumps writes compactly, so clients see the same stream as before.
    compact = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    assert event == b"data: " + compact + b"\n\n"
    assert render.DONE == b"data: [DONE]\n\n"
