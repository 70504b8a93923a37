"""Incremental detokenization and stop-string detection for one sequence (API side).

Text is decoded over a sliding window of token ids: the new text is what decoding the window gives
beyond decoding its older part. A window whose text ends in U+FFFD is an incomplete multi-byte
character, so the text waits for the next token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Prompt tokens used as left context for the first output tokens (spacing of word-piece tokenizers).
_CONTEXT_TOKENS = 5

TextDecoder = Callable[[list[int]], str]


def text_decoder(tokenizer: Any) -> TextDecoder:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, as one call per token can afford it.

    A transformers fast tokenizer's decode is its Rust tokenizer's decode plus optional space
    clean-up; the Python around that call costs three times the decode itself, and the API
    process decodes twice per token per stream. So a tokenizer whose decode adds nothing to its
    Rust tokenizer's is decoded by that directly; any other keeps its own decode."""
    if _decode_adds_nothing(tokenizer):
        decode = tokenizer.backend_tokenizer.decode
        return lambda ids: decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _decode_adds_nothing(tokenizer: Any) -> bool:
    """A transformers fast tokenizer with the library's own `_decode` and space clean-up off."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return False
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    return type(tokenizer)._decode is PreTrainedTokenizerFast._decode


class IncrementalDetokenizer:
    """The text of one sequence's output so far. Keeps only the prompt's last few tokens."""

    def __init__(self, decode: TextDecoder, prompt_token_ids: list[int]) -> None:
        self.decode = decode
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.token_ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)

    def append(self, token_id: int) -> str:
        """Add one token; returns the text it completes (may be "" until a character is whole)."""
        self.token_ids.append(token_id)
        end = len(self.token_ids)
        decode = self.decode
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = decode(self.token_ids[self.prefix_offset : end])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = end
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
