"""Incremental detokenization and stop-string detection for one sequence.

Text is decoded over a sliding window of token ids: the new text is what decoding the window gives
beyond decoding its older part. A window whose text ends in U+FFFD is an incomplete multi-byte
character, so the text waits for the next token.
"""

from __future__ import annotations

from typing import Any

from kvpilot.engine.sequence import Sequence

# Prompt tokens used as left context for the first output tokens (spacing of word-piece tokenizers).
_CONTEXT_TOKENS = 5


def init_offsets(seq: Sequence) -> None:
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.num_prompt_tokens - _CONTEXT_TOKENS, 0)


def decode_new_text(tokenizer: Any, seq: Sequence, num_ids: int | None = None) -> str:
    """Text added by the sequence's tokens up to num_ids (default: all); advances its offsets."""
    end = seq.num_tokens if num_ids is None else num_ids
    window = seq.token_ids[seq.prefix_offset : end]
    prefix_text = tokenizer.decode(
        seq.token_ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True
    )
    full_text = tokenizer.decode(window, skip_special_tokens=True)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    seq.prefix_offset = seq.read_offset
    seq.read_offset = end
    return full_text[len(prefix_text) :]


def find_stop_string(
    text: str, num_new_chars: int, stops: tuple[str, ...]
) -> tuple[int, str] | None:
    """The earliest stop string that appears in text and overlaps its last num_new_chars characters.

    Returns (index where it starts, the stop string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
